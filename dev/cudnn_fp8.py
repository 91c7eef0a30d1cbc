"""cuDNN's own FP8 attention (forward and backward), the vendor's 8-bit reference for the sage
benchmarks: Q, K, V, dO in e4m3 with one scale per tensor, S and dP quantized inside the kernels
with their own scales, fp32 accumulation; reached through the cudnn frontend's Python graph API
(package nvidia-cudnn-frontend; version 1.16 needs no other package, the GPU machine gets it as a
wheel: `python3 -m pip download --no-deps ... -d .whl nvidia-cudnn-frontend==1.16.0`, installed
with `--target`). On Hopper cuDNN writes O in FP8 (dequantized here for the accuracy check).

Scales: x8 = e4m3(x·s) with s = 448/amax(x), descale = 1/s. The softmax probabilities P ∈ [0, 1]
go to e4m3 with scale 448 (the scale_s of Transformer Engine's FP8 attention for P); O, dP and
the three gradients get 448/amax from a first, calibrating run (amax_* outputs), so that every
8-bit tensor uses e4m3's range as Transformer Engine's delayed scaling would after one step.

`Fp8Attention(q, k, v, dout)` builds both graphs for bf16 (B, H, N, D) inputs; `.forward()` and
`.backward()` run them (the timed calls); `.out()` and `.grads()` return fp32 results. Import
fails cleanly (ImportError) where the package is missing, and `Fp8Attention` raises
`cudnn.cudnnGraphNotSupportedError` or RuntimeError where the GPU or cuDNN lacks the kernels."""
import math

import torch

import cudnn

E4M3_MAX = 448.0


def _quantize(x):
    """(e4m3 copy of x, descale as a (1,1,1,1) fp32 tensor): x8 = e4m3(x·448/amax)."""
    amax = x.abs().amax().float().clamp_min(1e-12)
    scale = E4M3_MAX / amax
    return (x.float() * scale).to(torch.float8_e4m3fn), (1.0 / scale).reshape(1, 1, 1, 1)


def _scalar(value):
    return torch.full((1, 1, 1, 1), float(value), device="cuda", dtype=torch.float32)


def _fp32_scalar_outputs(*tensors):
    for t in tensors:
        t.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(cudnn.data_type.FLOAT)


class Fp8Attention:
    def __init__(self, q, k, v, dout):
        B, H, N, D = q.shape
        self.shape = (B, H, N, D)
        self.handle = cudnn.create_handle()
        cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        (self.q8, self.q_descale), (self.k8, self.k_descale), (self.v8, self.v_descale), (self.do8, self.do_descale) = (
            _quantize(x) for x in (q, k, v, dout))
        self.o8 = torch.empty(B, H, N, D, device="cuda", dtype=torch.float8_e4m3fn)
        self.stats = torch.empty(B, H, N, 1, device="cuda", dtype=torch.float32)
        self.grad8 = [torch.empty(B, H, N, D, device="cuda", dtype=torch.float8_e4m3fn) for _ in range(3)]
        self.amax = {n: _scalar(0) for n in ("s", "o", "dq", "dk", "dv", "dp")}
        # P's scale is fixed; O, dP and the gradients start at 1 and are calibrated below
        self.scale = {"s": _scalar(E4M3_MAX), "o": _scalar(1), "dp": _scalar(1),
                      "dq": _scalar(1), "dk": _scalar(1), "dv": _scalar(1)}
        self.descale = {"s": _scalar(1 / E4M3_MAX), "o": _scalar(1), "dp": _scalar(1)}
        self._build_forward(D)
        self._build_backward(D)
        self.forward()   # calibrate O's scale, then dP's and the gradients'
        self._calibrate("o")
        self.forward()
        self.backward()
        for n in ("dp", "dq", "dk", "dv"):
            self._calibrate(n)
        torch.cuda.synchronize()

    def _calibrate(self, name):
        amax = self.amax[name].clamp_min(1e-30)
        self.scale[name].copy_(E4M3_MAX / amax)
        if name in self.descale:
            self.descale[name].copy_(amax / E4M3_MAX)

    def _graph(self):
        return cudnn.pygraph(io_data_type=cudnn.data_type.FP8_E4M3, intermediate_data_type=cudnn.data_type.FLOAT,
                             compute_data_type=cudnn.data_type.FLOAT, handle=self.handle)

    def _bhnd(self):
        """dim and stride of a contiguous (B, H, N, D) tensor."""
        B, H, N, D = self.shape
        return [B, H, N, D], [H * N * D, N * D, D, 1]

    def _tensors(self, g, names):
        dim, stride = self._bhnd()
        return [g.tensor(name=n, dim=dim, stride=stride, data_type=cudnn.data_type.FP8_E4M3) for n in names]

    @staticmethod
    def _scalars(g, names):
        return [g.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.FLOAT)
                for n in names]

    @staticmethod
    def _finish(g):
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        return torch.empty(g.get_workspace_size(), device="cuda", dtype=torch.uint8)

    def _build_forward(self, D):
        g = self._graph()
        q, k, v = self._tensors(g, ("q", "k", "v"))
        sc = self._scalars(g, ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o"))
        o, stats, amax_s, amax_o = g.sdpa_fp8(q=q, k=k, v=v, descale_q=sc[0], descale_k=sc[1], descale_v=sc[2],
                                              descale_s=sc[3], scale_s=sc[4], scale_o=sc[5], is_inference=False,
                                              attn_scale=1.0 / math.sqrt(D), use_causal_mask=False, name="fwd")
        B, H, N, _ = self.shape
        dim, stride = self._bhnd()
        o.set_output(True).set_dim(dim).set_stride(stride)
        stats.set_output(True).set_dim([B, H, N, 1]).set_stride([H * N, N, 1, 1]).set_data_type(
            cudnn.data_type.FLOAT)
        _fp32_scalar_outputs(amax_s, amax_o)
        self.fwd_ws = self._finish(g)
        self.fwd_graph = g
        self.fwd_pack = {q: self.q8, k: self.k8, v: self.v8, sc[0]: self.q_descale, sc[1]: self.k_descale,
                         sc[2]: self.v_descale, sc[3]: self.descale["s"], sc[4]: self.scale["s"],
                         sc[5]: self.scale["o"],
                         o: self.o8, stats: self.stats, amax_s: self.amax["s"], amax_o: self.amax["o"]}

    def _build_backward(self, D):
        g = self._graph()
        q, k, v, o, do = self._tensors(g, ("q", "k", "v", "o", "do"))
        B, H, N, _ = self.shape
        stats = g.tensor(name="stats", dim=[B, H, N, 1], stride=[H * N, N, 1, 1], data_type=cudnn.data_type.FLOAT)
        names = ("descale_q", "descale_k", "descale_v", "descale_o", "descale_do", "descale_s", "descale_dp",
                 "scale_s", "scale_dq", "scale_dk", "scale_dv", "scale_dp")
        sc = self._scalars(g, names)
        dq, dk, dv, amax_dq, amax_dk, amax_dv, amax_dp = g.sdpa_fp8_backward(
            q=q, k=k, v=v, o=o, dO=do, stats=stats, descale_q=sc[0], descale_k=sc[1], descale_v=sc[2],
            descale_o=sc[3], descale_dO=sc[4], descale_s=sc[5], descale_dP=sc[6], scale_s=sc[7], scale_dQ=sc[8],
            scale_dK=sc[9], scale_dV=sc[10], scale_dP=sc[11], attn_scale=1.0 / math.sqrt(D), use_causal_mask=False,
            name="bwd")
        dim, stride = self._bhnd()
        for t in (dq, dk, dv):
            t.set_output(True).set_dim(dim).set_stride(stride)
        _fp32_scalar_outputs(amax_dq, amax_dk, amax_dv, amax_dp)
        self.bwd_ws = self._finish(g)
        self.bwd_graph = g
        values = (self.q_descale, self.k_descale, self.v_descale, self.descale["o"], self.do_descale, self.descale["s"],
                  self.descale["dp"], self.scale["s"], self.scale["dq"], self.scale["dk"], self.scale["dv"],
                  self.scale["dp"])
        self.bwd_pack = {q: self.q8, k: self.k8, v: self.v8, o: self.o8, do: self.do8, stats: self.stats,
                         dq: self.grad8[0], dk: self.grad8[1], dv: self.grad8[2], amax_dq: self.amax["dq"],
                         amax_dk: self.amax["dk"], amax_dv: self.amax["dv"], amax_dp: self.amax["dp"]}
        self.bwd_pack.update(dict(zip(sc, values)))

    def forward(self):
        self.fwd_graph.execute(self.fwd_pack, self.fwd_ws, handle=self.handle)

    def backward(self):
        self.bwd_graph.execute(self.bwd_pack, self.bwd_ws, handle=self.handle)

    def out(self):
        return self.o8.float() / self.scale["o"]

    def grads(self):
        return [g.float() / self.scale[n] for g, n in zip(self.grad8, ("dq", "dk", "dv"))]
