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

# ---- library sources: every .c (and .cu with CUDA) in the library folders -
LIB_DIRS  := layers attention model dataloader
LIB_C     := $(wildcard $(addsuffix /*.c,$(LIB_DIRS)))
LIB_CU    := $(if $(NVCC),$(wildcard $(addsuffix /*.cu,$(LIB_DIRS))))
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
	ar rcs $@ $^

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

# make data: Fashion-MNIST's train split (Debian's dataset-fashion-mnist) as an image folder
FASHION_MNIST_SRC ?= /usr/share/datasets/fashion-mnist
$(BUILD)/make_fashion_mnist: dev/make_fashion_mnist.c $(BUILD)/dataloader/image_grid.o $(BUILD)/layers/common.o
	$(CC) $(CFLAGS) -o $@ $^ $(LDLIBS)

data: $(BUILD)/make_fashion_mnist
	$(BUILD)/make_fashion_mnist $(FASHION_MNIST_SRC) data/fashion-mnist

clean:
	rm -rf $(BUILD) train_dit

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
