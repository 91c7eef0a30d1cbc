# dit.c build. CPU parts need only a C compiler and libm; CUDA parts are built
# when nvcc is found (NO_CUDA=1 forces a CPU-only build), NCCL parts when nccl.h is found.
#   make train_dit     the trainer
#   make test          every test (GPU tests skip without a GPU)
#   make data          Fashion-MNIST as an image folder (data/fashion-mnist)
#   make clean

CC      ?= cc
CFLAGS  ?= -O3 -g
CFLAGS  += -std=c11 -Wall -Wextra -D_GNU_SOURCE -MMD -MP -I. -fopenmp
LDLIBS  += -lm -lpthread
PYTHON  ?= /usr/bin/python3
BUILD   := build
SHELL   := /bin/bash

# ---- CUDA detection (like llm.c) ------------------------------------------
NVCC := $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
ifeq ($(NO_CUDA),1)
  NVCC :=
endif
ifneq ($(NVCC),)
  CUDA_HOME  := $(patsubst %/bin/nvcc,%,$(NVCC))
  NVCC_FLAGS := -O3 -std=c++17 -I. --use_fast_math -Xcompiler -Wall -MMD -MP \
                -gencode=arch=compute_80,code=sm_80 \
                -gencode=arch=compute_90a,code=sm_90a
  CFLAGS     += -DDIT_CUDA -I$(CUDA_HOME)/include
  LDLIBS     += -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcublasLt -lcublas -lcudart -lstdc++
  $(info dit.c: nvcc found at $(NVCC): building the CUDA parts)
else
  $(info dit.c: no nvcc (or NO_CUDA=1): CPU-only build)
endif

# ---- NCCL detection: nccl.h beside CUDA's headers or in /usr/include (with nvcc only) ----------
NCCL_H := $(if $(NVCC),$(firstword $(wildcard $(CUDA_HOME)/include/nccl.h /usr/include/nccl.h)))
ifneq ($(NCCL_H),)
  CFLAGS     += -DDIT_NCCL
  NVCC_FLAGS += -DDIT_NCCL
  LDLIBS     += -lnccl
  $(info dit.c: nccl.h found at $(NCCL_H): building the NCCL parts (*_nccl.cu))
endif

# ---- library sources: every .c (and .cu with CUDA) in the library folders -
LIB_DIRS  := layers attention model dataloader
LIB_C     := $(wildcard $(addsuffix /*.c,$(LIB_DIRS)))
LIB_CU    := $(if $(NVCC),$(wildcard $(addsuffix /*.cu,$(LIB_DIRS))))
ifeq ($(NCCL_H),)
  LIB_CU  := $(filter-out %_nccl.cu,$(LIB_CU))
endif
LIB_OBJS  := $(patsubst %.c,$(BUILD)/%.o,$(LIB_C)) $(patsubst %.cu,$(BUILD)/%.o,$(LIB_CU))
LIB       := $(BUILD)/libditc.a

# ---- tests: test/test_*.c are Criterion tests; test_*_cuda.c need CUDA ----
TEST_C    := $(wildcard test/test_*.c)
ifeq ($(NVCC),)
  TEST_C  := $(filter-out %_cuda.c,$(TEST_C))
endif
TEST_BINS := $(patsubst test/%.c,$(BUILD)/%,$(TEST_C))

# ---- fuzz targets: test/fuzz_*.c, libFuzzer (clang), each run FUZZ_SECONDS --
FUZZ_CC      ?= clang
FUZZ_SECONDS ?= 60
FUZZ_C       := $(wildcard test/fuzz_*.c)
FUZZ_BINS    := $(patsubst test/%.c,$(BUILD)/%,$(FUZZ_C))
FUZZ_LIB_C   := $(filter-out %.cu,$(LIB_C))

.PHONY: all test clean data lib fuzz
all: train_dit

train_dit: train_dit.c $(LIB)
	$(CC) $(CFLAGS) -o $@ $< $(LIB) $(LDLIBS)

lib: $(LIB)
$(LIB): $(LIB_OBJS)
	@mkdir -p $(@D)
	rm -f $@ && ar rcs $@ $^   # from scratch: a deleted source leaves no stale member

$(BUILD)/%.o: %.c
	@mkdir -p $(@D)
	$(CC) $(CFLAGS) -c -o $@ $<

$(BUILD)/%.o: %.cu
	@mkdir -p $(@D)
	$(NVCC) $(NVCC_FLAGS) -c -o $@ $<

$(BUILD)/test_%: test/test_%.c $(LIB)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS) -o $@ $< $(LIB) $(LDLIBS) -lcriterion

# Each Criterion binary runs; then the PyTorch parity check (dev/parity.py); then the fuzzers.
test: $(TEST_BINS) train_dit
	@set -e; for t in $(TEST_BINS); do echo "== $$t"; $$t --jobs 2; done
	@echo "== PyTorch parity"; $(PYTHON) dev/parity.py
	@echo "== PyTorch parity, clipping active"; $(PYTHON) dev/parity.py --steps 12 --grad-clip 0.5
	@$(MAKE) --no-print-directory test-example
	@$(MAKE) --no-print-directory fuzz

$(BUILD)/fuzz_%: test/fuzz_%.c $(FUZZ_LIB_C)
	@mkdir -p $(@D)
	$(FUZZ_CC) -std=c11 -D_GNU_SOURCE -I. -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -o $@ $^ -lm -lpthread

# Each fuzzer runs for FUZZ_SECONDS from its seed corpus in test/corpus/<name>/.
fuzz: $(FUZZ_BINS)
	@set -e; for f in $(FUZZ_BINS); do n=$${f##*/fuzz_}; mkdir -p $(BUILD)/corpus/$$n; \
	  echo "== $$f ($(FUZZ_SECONDS) s)"; \
	  $$f -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 -artifact_prefix=$(BUILD)/fuzz_$$n- $(BUILD)/corpus/$$n test/corpus/$$n 2>&1 | grep -E 'stat::number_of_executed_units|ERROR|SUMMARY' ; \
	  test $${PIPESTATUS[0]} -eq 0; done

# ---- the library for other programs ------------------------------------------------------
#   make lib                    build/libditc.a and build/libditc.so
#   make install PREFIX=DIR     DIR/include/ditc/<folder>/*.h, DIR/lib/libditc.{a,so}, DIR/lib/pkgconfig/ditc.pc
#   make example PREFIX=DIR     dev/example_attention_layer.c built against the installed library
# The shared library is linked from position-independent copies of the objects (build/pic/).
PREFIX       ?= /usr/local
DITC_VERSION := 0.1.0
SHLIB        := $(BUILD)/libditc.so
PIC_OBJS     := $(patsubst $(BUILD)/%,$(BUILD)/pic/%,$(LIB_OBJS))
PUBLIC_H     := layers/common.h layers/layers.h attention/attention.h attention/sequence_parallel.h \
                dataloader/dataloader.h \
                dataloader/image_grid.h model/dit.h model/safetensors.h model/checkpoint.h model/sample.h \
                $(if $(NVCC),layers/layers_cuda.h attention/sage_cuda.h attention/flash_cuda.h attention/hadamard_cuda.h \
                  model/dit_gpu.h) \
                $(if $(NCCL_H),attention/sequence_parallel_cuda.h)
PC_CFLAGS    := $(if $(NVCC),-DDIT_CUDA -I$(CUDA_HOME)/include)
,            := ,
PC_LIBS      := $(if $(NVCC),-L$(CUDA_HOME)/lib64 -Wl$(,)-rpath$(,)$(CUDA_HOME)/lib64 -lcudart)
INSTALL_DIR   = $(abspath $(DESTDIR)$(PREFIX))

.PHONY: install example test-example
lib: $(SHLIB)
$(SHLIB): $(PIC_OBJS)
	$(CC) -shared -fopenmp -Wl,-soname,libditc.so.0 -o $@ $^ $(LDLIBS)

$(BUILD)/pic/%.o: %.c
	@mkdir -p $(@D)
	$(CC) $(CFLAGS) -fPIC -c -o $@ $<

$(BUILD)/pic/%.o: %.cu
	@mkdir -p $(@D)
	$(NVCC) $(NVCC_FLAGS) -Xcompiler -fPIC -c -o $@ $<

install: $(LIB) $(SHLIB)
	@for h in $(PUBLIC_H); do install -D -m 644 $$h $(INSTALL_DIR)/include/ditc/$$h; done
	install -d $(INSTALL_DIR)/lib/pkgconfig
	install -m 644 $(LIB) $(INSTALL_DIR)/lib/libditc.a
	install -m 755 $(SHLIB) $(INSTALL_DIR)/lib/libditc.so.0
	ln -sf libditc.so.0 $(INSTALL_DIR)/lib/libditc.so
	sed -e 's|@PREFIX@|$(abspath $(PREFIX))|' -e 's|@VERSION@|$(DITC_VERSION)|' -e 's|@CFLAGS@|$(PC_CFLAGS)|' -e 's|@LIBS@|$(PC_LIBS)|' \
	    -e 's|@LIBS_PRIVATE@|-fopenmp $(LDLIBS)|' dev/ditc.pc.in > $(INSTALL_DIR)/lib/pkgconfig/ditc.pc

# The example, as another program builds it: pkg-config against PREFIX, shared and static.
EXAMPLE_CFLAGS := -std=c11 -O2 -Wall -Wextra -Werror
example:
	@command -v pkg-config >/dev/null || { echo "make example: needs pkg-config (apt-get install pkgconf)"; exit 1; }
	@mkdir -p $(BUILD)
	export PKG_CONFIG_PATH=$(abspath $(PREFIX))/lib/pkgconfig; \
	$(CC) $(EXAMPLE_CFLAGS) $$(pkg-config --cflags ditc) -o $(BUILD)/example_attention_layer \
	    dev/example_attention_layer.c $$(pkg-config --libs ditc) -Wl,-rpath,$$(pkg-config --variable=libdir ditc) && \
	$(CC) $(EXAMPLE_CFLAGS) $$(pkg-config --cflags ditc) -o $(BUILD)/example_attention_layer_static \
	    dev/example_attention_layer.c -Wl,--as-needed $$(pkg-config --variable=libdir ditc)/libditc.a $$(pkg-config --static --libs ditc)

# make test's library check: install into a fresh prefix, build the example against it, run both builds.
test-example: $(LIB) $(SHLIB)
	@set -e; prefix=$$(mktemp -d); trap 'rm -rf "$$prefix"' EXIT; \
	  $(MAKE) --no-print-directory install PREFIX=$$prefix >/dev/null; \
	  $(MAKE) --no-print-directory example PREFIX=$$prefix >/dev/null; \
	  echo "== example_attention_layer (shared, installed in $$prefix)"; $(BUILD)/example_attention_layer; \
	  echo "== example_attention_layer (static)"; $(BUILD)/example_attention_layer_static

# make data: Fashion-MNIST's train split (Debian's dataset-fashion-mnist) as an image folder
FASHION_MNIST_SRC ?= /usr/share/datasets/fashion-mnist
$(BUILD)/make_fashion_mnist: dev/make_fashion_mnist.c $(BUILD)/dataloader/image_grid.o $(BUILD)/layers/common.o
	$(CC) $(CFLAGS) -o $@ $^ $(LDLIBS)

data: $(BUILD)/make_fashion_mnist
	$(BUILD)/make_fashion_mnist $(FASHION_MNIST_SRC) data/fashion-mnist

# The CPU accuracy tools of sage attention, dev/sage_*_accuracy.c (make build/sage_bwd_int8_accuracy)
$(BUILD)/sage_%_accuracy: dev/sage_%_accuracy.c $(LIB)
	$(CC) $(CFLAGS) -o $@ $< $(LIB) $(LDLIBS)

clean:
	rm -rf $(BUILD) train_dit

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
