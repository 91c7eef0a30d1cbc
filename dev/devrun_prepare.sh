#!/usr/bin/env bash
# Prepares .devrun/ (binaries) and .devlibs/ (Criterion's runtime libraries) for the GPU machine,
# which has CUDA and NCCL but no Criterion. Both folders are git-ignored and travel with the `carry`
# option of the device tool; build/ itself is too big to carry. Then, on the GPU machine:
#   BIN=.devrun LOGS=/tmp/logs bash dev/gpu_suite.sh [tests|bench|all|multi]; tar czf $OUT/logs.tgz -C /tmp/logs .
# (the device tool returns at most 8 files from $OUT: one archive of all the logs)
set -euo pipefail
make -j2 train_dit build/libditc.so build/libditc.a
NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
FLAGS="-O3 -std=c++17 -I. --use_fast_math -Xcompiler -fPIC -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90a,code=sm_90a"
gcc -O2 -fPIC -std=c11 -D_GNU_SOURCE -I. -c layers/common.c -o build/common_pic.o
# each library rebuilt when it is missing or older than a source
stale() { [ ! -f "$1" ] || [ -n "$(find attention layers -newer "$1")" ]; }
if stale build/libsage_bench.so; then
    $NVCC $FLAGS -shared -o build/libsage_bench.so attention/sage_quant.cu attention/sage_forward.cu \
        attention/sage_forward_sm90.cu attention/sage_backward.cu attention/sage_backward_sm90.cu build/common_pic.o
fi
if stale build/libflash_bench.so; then
    $NVCC $FLAGS -shared -o build/libflash_bench.so attention/flash_forward.cu attention/flash_forward_sm90.cu \
        attention/flash_backward.cu attention/flash_backward_sm90.cu build/common_pic.o
fi
gcc -O2 -Wall -shared -fPIC -I/usr/local/cuda/include dev/kernel_times.c -o build/libkernel_times.so \
    -L/usr/local/cuda/lib64 -Wl,-rpath,/usr/local/cuda/lib64 -lcupti -lstdc++
CUDA_LINK="-lm -lpthread -L/usr/local/cuda/lib64 -Wl,-rpath,/usr/local/cuda/lib64 -lcublasLt -lcublas -lcudart -lstdc++"
[ -f /usr/local/cuda/include/nccl.h ] && CUDA_LINK="$CUDA_LINK -lnccl"
cc -O2 -std=c11 -Wall -Wextra -D_GNU_SOURCE -I. -fopenmp -DDIT_CUDA -I/usr/local/cuda/include \
    -o build/sanitize_attention dev/sanitize_attention.c build/libditc.a $CUDA_LINK
rm -rf .devrun && mkdir -p .devrun .devlibs
cp train_dit build/sanitize_attention build/libsage_bench.so build/libflash_bench.so build/libkernel_times.so .devrun/
cp build/libditc.so .devrun/libditc.so
cp build/libditc.so .devrun/libditc.so.0   # its soname
# The device tool carries at most 64 MiB with the tree: the GPU tests, each ~5 MB when linked
# against libditc.a, are linked here against the one libditc.so beside them (rpath $ORIGIN).
for t in test/test_*_cuda.c; do
    name=$(basename "$t" .c)
    cc -O2 -std=c11 -D_GNU_SOURCE -I. -fopenmp -DDIT_CUDA $([ -f /usr/local/cuda/include/nccl.h ] && echo -DDIT_NCCL) \
        -I/usr/local/cuda/include -o .devrun/$name "$t" -L.devrun -l:libditc.so.0 -Wl,-rpath,'$ORIGIN' $CUDA_LINK \
        -lcriterion
done
strip --strip-unneeded .devrun/*
for b in .devrun/test_*_cuda; do
    cp -n $(ldd "$b" | awk '/criterion|git2|nanomsg|ffi|http_parser|mbed|ssh|pcre|gomp|krb5|k5crypto|com_err|keyutils|gssapi|crypto|libz/{print $3}') .devlibs/ 2>/dev/null || true
done
du -sh .devrun .devlibs
