"""PyTorch reference of dit.c's DiT: facebookresearch/DiT's model (same parameter names as its
state_dict) trained with flow matching instead of DDPM.

    x_t = (1 - t) x0 + t eps,   v = eps - x0,   loss = mean((model(x_t, t, y) - v)^2)

t in [0, 1] is embedded as DiT's timestep tau = 1000 t. in = out channels (no learned sigma),
the label table always has the null class (row num_classes), pos_embed is a fixed buffer (not
a parameter, not saved). Runs on torch 1.13 CPU (plain attention) and torch 2.x on a GPU
(use_sdpa=True picks F.scaled_dot_product_attention).

    python3 dev/dit_ref.py [cuda]   # self-test: zero output at DiT init, float64 finite
                                    # differences; on torch 2.x also SDPA and bf16
"""
import math
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class DiTConfig:
    image_size: int = 32
    channels: int = 4
    patch: int = 2
    hidden: int = 384
    depth: int = 12
    heads: int = 6
    num_classes: int = 1000
    mlp_ratio: int = 4
    freq_dim: int = 256   # sinusoidal timestep features

    @staticmethod
    def from_metadata(meta):
        """The config from a dump's __metadata__ (all values are strings)."""
        keys = ("image_size", "channels", "patch", "hidden", "depth", "heads", "num_classes")
        return DiTConfig(**{k: int(meta[k]) for k in keys})


# ---- fixed 2D sin-cos position embedding, exactly DiT's get_2d_sincos_pos_embed ------------
def get_1d_sincos_pos_embed_from_grid(embed_dim, pos):
    # pos (M,) -> (M, embed_dim) = [sin(pos * omega) | cos(pos * omega)], omega = 10000^(-2i/D)
    omega = np.arange(embed_dim // 2, dtype=np.float64)
    omega /= embed_dim / 2.0
    omega = 1.0 / 10000 ** omega
    out = np.einsum("m,d->md", pos.reshape(-1), omega)
    return np.concatenate([np.sin(out), np.cos(out)], axis=1)


def get_2d_sincos_pos_embed(embed_dim, grid_size):
    # (G*G, D), token t = gy*G + gx. As in DiT, the first D/2 columns embed gx (meshgrid puts w
    # first), the last D/2 embed gy.
    grid_h = np.arange(grid_size, dtype=np.float32)
    grid_w = np.arange(grid_size, dtype=np.float32)
    grid = np.stack(np.meshgrid(grid_w, grid_h), axis=0).reshape([2, 1, grid_size, grid_size])
    emb_h = get_1d_sincos_pos_embed_from_grid(embed_dim // 2, grid[0])
    emb_w = get_1d_sincos_pos_embed_from_grid(embed_dim // 2, grid[1])
    return np.concatenate([emb_h, emb_w], axis=1)


def modulate(x, shift, scale):
    # x (B, T, h), shift/scale (B, h) -> x * (1 + scale) + shift
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def timestep_features(t, dim):
    # t (B,) in [0, 1] -> (B, dim) = [cos(tau f) | sin(tau f)], tau = 1000 t, f_i = 10000^(-i/half)
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(0, half, dtype=torch.float32) / half).to(t.device)
    args = (1000.0 * t.float())[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class PatchEmbed(nn.Module):
    # (B, C, S, S) -> (B, T, h) with a stride-p convolution; token t = gy*(S/p) + gx
    def __init__(self, cfg):
        super().__init__()
        self.proj = nn.Conv2d(cfg.channels, cfg.hidden, cfg.patch, stride=cfg.patch)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class TimestepEmbedder(nn.Module):
    # t (B,) -> (B, h): sinusoidal features -> Linear -> SiLU -> Linear
    def __init__(self, cfg):
        super().__init__()
        self.freq_dim = cfg.freq_dim
        self.mlp = nn.Sequential(nn.Linear(cfg.freq_dim, cfg.hidden), nn.SiLU(), nn.Linear(cfg.hidden, cfg.hidden))

    def forward(self, t):
        return self.mlp(timestep_features(t, self.freq_dim).to(self.mlp[0].weight.dtype))


class LabelEmbedder(nn.Module):
    # y (B,) in [0, num_classes] (num_classes = the null class, dropout applied by the caller) -> (B, h)
    def __init__(self, cfg):
        super().__init__()
        self.embedding_table = nn.Embedding(cfg.num_classes + 1, cfg.hidden)

    def forward(self, y):
        return self.embedding_table(y)


class Attention(nn.Module):
    # (B, T, h) -> (B, T, h): qkv -> heads -> softmax(q k^T / sqrt(hd)) v -> proj
    def __init__(self, cfg, use_sdpa):
        super().__init__()
        self.heads = cfg.heads
        self.use_sdpa = use_sdpa
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x):
        B, T, h = x.shape
        qkv = self.qkv(x).reshape(B, T, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]   # (B, heads, T, hd)
        if self.use_sdpa:
            y = F.scaled_dot_product_attention(q, k, v)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
            y = att.softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(B, T, h))


class Mlp(nn.Module):
    # (B, T, h) -> fc1 (4h) -> GELU(tanh) -> fc2 (h)
    def __init__(self, cfg):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden, cfg.mlp_ratio * cfg.hidden)
        self.fc2 = nn.Linear(cfg.mlp_ratio * cfg.hidden, cfg.hidden)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class DiTBlock(nn.Module):
    # adaLN-Zero block: c (B, h) -> 6 modulation vectors; gated residual attention and MLP
    def __init__(self, cfg, use_sdpa):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(cfg, use_sdpa)
        self.norm2 = nn.LayerNorm(cfg.hidden, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(cfg)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(cfg.hidden, 6 * cfg.hidden))

    def forward(self, x, c):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        x = x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x


class FinalLayer(nn.Module):
    # (B, T, h), c -> (B, T, p*p*C): adaLN (shift, scale) then Linear
    def __init__(self, cfg):
        super().__init__()
        self.norm_final = nn.LayerNorm(cfg.hidden, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(cfg.hidden, cfg.patch * cfg.patch * cfg.channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(cfg.hidden, 2 * cfg.hidden))

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class DiT(nn.Module):
    def __init__(self, cfg, use_sdpa=False):
        super().__init__()
        assert cfg.hidden % cfg.heads == 0 and cfg.image_size % cfg.patch == 0
        self.cfg = cfg
        self.grid = cfg.image_size // cfg.patch
        self.x_embedder = PatchEmbed(cfg)
        self.t_embedder = TimestepEmbedder(cfg)
        self.y_embedder = LabelEmbedder(cfg)
        pos = torch.from_numpy(get_2d_sincos_pos_embed(cfg.hidden, self.grid)).float().unsqueeze(0)
        self.register_buffer("pos_embed", pos, persistent=False)   # (1, T, h), fixed
        self.blocks = nn.ModuleList([DiTBlock(cfg, use_sdpa) for _ in range(cfg.depth)])
        self.final_layer = FinalLayer(cfg)
        self.initialize_weights()

    def initialize_weights(self):
        # DiT's init: xavier-uniform linears with zero bias, N(0, 0.02) label table and timestep
        # MLP, zero adaLN modulations and final linear (so the initial output is exactly zero).
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        w = self.x_embedder.proj.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.zeros_(self.x_embedder.proj.bias)
        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        for block in self.blocks:
            nn.init.zeros_(block.adaLN_modulation[-1].weight)
            nn.init.zeros_(block.adaLN_modulation[-1].bias)
        nn.init.zeros_(self.final_layer.adaLN_modulation[-1].weight)
        nn.init.zeros_(self.final_layer.adaLN_modulation[-1].bias)
        nn.init.zeros_(self.final_layer.linear.weight)
        nn.init.zeros_(self.final_layer.linear.bias)

    def unpatchify(self, x):
        # (B, T, p*p*C) -> (B, C, S, S)
        p, C, G = self.cfg.patch, self.cfg.channels, self.grid
        x = x.reshape(x.shape[0], G, G, p, p, C)
        x = torch.einsum("nhwpqc->nchpwq", x)
        return x.reshape(x.shape[0], C, G * p, G * p)

    def forward(self, x, t, y):
        # x (B, C, S, S), t (B,) in [0, 1], y (B,) int -> velocity (B, C, S, S)
        x = self.x_embedder(x) + self.pos_embed.to(x.dtype)
        c = self.t_embedder(t) + self.y_embedder(y)
        for block in self.blocks:
            x = block(x, c)
        return self.unpatchify(self.final_layer(x, c))


def make_model(cfg, device="cpu", dtype=torch.float32, use_sdpa=None):
    # A DiT with DiT's init (made in fp32 on the CPU, so every device starts from the same
    # weights for a given seed), moved to device/dtype. use_sdpa=None: SDPA where torch has it.
    if use_sdpa is None:
        use_sdpa = hasattr(F, "scaled_dot_product_attention")
    return DiT(cfg, use_sdpa=use_sdpa).to(device=device, dtype=dtype)


def flow_matching_loss(model, x0, t, y, noise):
    # x_t = (1 - t) x0 + t noise, target v = noise - x0; returns (loss, model output)
    tb = t.view(-1, 1, 1, 1).to(x0.dtype)
    out = model((1 - tb) * x0 + tb * noise, t, y)
    dtype = torch.promote_types(out.dtype, torch.float32)   # bf16 runs take the mean in fp32
    return ((out.to(dtype) - (noise - x0).to(dtype)) ** 2).mean(), out


def make_optimizer(model, lr, betas, eps, weight_decay):
    # AdamW with weight decay only on parameters with ndim >= 2 (matrices, conv kernels, tables)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)


def forward_backward(model, x0, t, y, noise):
    # Zeroes the gradients, then loss.backward(); returns (loss, output), gradients in p.grad.
    model.zero_grad(set_to_none=True)
    loss, out = flow_matching_loss(model, x0, t, y, noise)
    loss.backward()
    return loss.detach(), out.detach()


def clip_and_step(model, optimizer, grad_clip):
    # Global L2 norm of the gradients (returned, before clipping), clip to grad_clip (skipped
    # when grad_clip <= 0), one AdamW step.
    if grad_clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=grad_clip)
    else:
        norm = torch.norm(torch.stack([p.grad.detach().float().norm(2) for p in model.parameters()
                                       if p.grad is not None]), 2)
    optimizer.step()
    return norm.detach()


def randomize_zero_init(model, std, generator=None):
    # Replaces DiT's zero-initialized tensors (adaLN modulations, final linear) by N(0, std) so
    # that every gradient is nonzero: for tests, where zeros would hide most of the network.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "adaLN_modulation" in name or name.startswith("final_layer.linear"):
                p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * std)


# ---- self-test -------------------------------------------------------------------------------
def _self_test(device):
    torch.manual_seed(0)
    cfg = DiTConfig(image_size=8, channels=3, patch=2, hidden=32, depth=2, heads=4, num_classes=5)
    B = 3
    model = DiT(cfg)
    x0 = torch.randn(B, cfg.channels, cfg.image_size, cfg.image_size)
    t = torch.rand(B)
    y = torch.tensor([0, 4, cfg.num_classes])
    noise = torch.randn_like(x0)
    failures = 0

    out = model(x0, t, y)
    ok = out.shape == x0.shape and bool((out == 0).all())
    print(f"output at DiT init is exactly zero, shape {tuple(out.shape)}: {'OK' if ok else 'NOT OK'}")
    failures += not ok

    # Randomize the zero-initialized layers so every gradient is nonzero, then compare autograd
    # with central differences in float64 on a few entries of several parameters.
    model = model.double()
    randomize_zero_init(model, 0.1)
    x0, noise, t = x0.double(), noise.double(), t.double()
    forward_backward(model, x0, t, y, noise)
    params = dict(model.named_parameters())
    checks = [("x_embedder.proj.weight", (5, 1, 1, 0)), ("t_embedder.mlp.0.weight", (3, 17)),
              ("y_embedder.embedding_table.weight", (4, 7)), ("blocks.0.attn.qkv.weight", (40, 3)),
              ("blocks.0.attn.qkv.bias", (70,)), ("blocks.1.mlp.fc1.weight", (100, 31)),
              ("blocks.0.adaLN_modulation.1.weight", (75, 2)), ("blocks.1.attn.proj.bias", (9,)),
              ("final_layer.adaLN_modulation.1.bias", (33,)), ("final_layer.linear.weight", (11, 20))]
    h = 1e-4   # truncation error ~h^2, rounding ~1e-16 |loss| / h: both far below the tolerance
    for name, index in checks:
        p = params[name]
        with torch.no_grad():
            saved = p[index].item()
            p[index] = saved + h
            up = flow_matching_loss(model, x0, t, y, noise)[0].item()
            p[index] = saved - h
            down = flow_matching_loss(model, x0, t, y, noise)[0].item()
            p[index] = saved
        numeric = (up - down) / (2 * h)
        analytic = p.grad[index].item()
        rel = abs(numeric - analytic) / max(abs(analytic), 1e-12)
        ok = abs(numeric - analytic) <= 1e-6 * abs(analytic) + 1e-11 and analytic != 0
        failures += not ok
        print(f"d loss / d {name}{list(index)}: autograd {analytic:+.10e} finite diff {numeric:+.10e} "
              f"rel {rel:.1e} {'OK' if ok else 'NOT OK'}")

    if hasattr(F, "scaled_dot_product_attention"):
        a = make_model(cfg, device, torch.float64, use_sdpa=False)
        randomize_zero_init(a, 0.1)
        b = make_model(cfg, device, torch.float64, use_sdpa=True)
        b.load_state_dict(a.state_dict())
        xd, td, nd, yd = x0.to(device), t.to(device), noise.to(device), y.to(device)
        oa, ob = a(xd, td, yd), b(xd, td, yd)
        rel = ((oa - ob).norm() / oa.norm()).item()
        ok = rel < 1e-10
        failures += not ok
        print(f"SDPA vs plain attention (float64, {device}): rel {rel:.1e} {'OK' if ok else 'NOT OK'}")
        # bf16 weights and activations (SDPA) against fp32: loss within 2%, all gradients finite
        results = {}
        for dtype in (torch.float32, torch.bfloat16):
            m = make_model(cfg, device, dtype)
            m.load_state_dict(a.state_dict())
            loss, _ = forward_backward(m, xd.to(dtype), td, yd, nd.to(dtype))
            finite = all(bool(torch.isfinite(p.grad).all()) for p in m.parameters())
            results[dtype] = (loss.item(), finite)
        rel = abs(results[torch.bfloat16][0] - results[torch.float32][0]) / results[torch.float32][0]
        ok = rel < 2e-2 and results[torch.bfloat16][1] and results[torch.float32][1]
        failures += not ok
        print(f"bf16 vs fp32 loss ({device}): {results[torch.bfloat16][0]:.6f} vs {results[torch.float32][0]:.6f}, "
              f"rel {rel:.1e}, gradients finite: {results[torch.bfloat16][1]} {'OK' if ok else 'NOT OK'}")
    else:
        print("SDPA and bf16 checks: skipped (no F.scaled_dot_product_attention in torch "
              f"{torch.__version__})")

    print("dit_ref self-test:", "all OK" if failures == 0 else f"{failures} FAILED")
    return failures


if __name__ == "__main__":
    raise SystemExit(1 if _self_test(sys.argv[1] if len(sys.argv) > 1 else "cpu") else 0)
