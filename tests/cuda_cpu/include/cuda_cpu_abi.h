// The interface between the CPU execution harness's runtime (runtime.cpp) and the
// kernel modules it runs (one shared object per CuPy RawModule, see build.py).
//
// Kernel code never includes this file directly: cuda_cpu.h (the stand-in for
// CUDA's built-ins) does, and the generated registration code of each module uses
// the descriptor types below to tell the runtime what each kernel's parameters are.
#pragma once

#include <cstddef>
#include <cstdint>

struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x = 1, y = 1, z = 1;
  dim3() = default;
  constexpr dim3(unsigned int x_, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};

extern "C" {

// what a kernel thread sees: its own index, and the launch geometry
struct pnc_thread {
  uint3 tid;
};
extern pnc_thread* pnc_current;  // the running thread (fiber)
extern uint3 pnc_block_idx;      // the block being run (blocks run one at a time)
extern dim3 pnc_block_dim;
extern dim3 pnc_grid_dim;

// synchronization points: each one suspends the calling thread until the others arrive
void pnc_syncthreads(const char* site);  // site: "file:line" of the __syncthreads call
void pnc_syncwarp(unsigned int mask);
enum pnc_shfl_op { PNC_SHFL_IDX = 0, PNC_SHFL_UP = 1, PNC_SHFL_DOWN = 2, PNC_SHFL_XOR = 3 };
uint64_t pnc_shfl(unsigned int mask, uint64_t value, int op, int arg, int width);

// a kernel parameter, as the registration code describes it
enum pnc_kind { PNC_POINTER = 0, PNC_SIGNED = 1, PNC_UNSIGNED = 2, PNC_FLOAT = 3, PNC_OTHER = 4 };
struct pnc_param {
  int kind;          // pnc_kind of the parameter itself
  int size;          // sizeof the parameter
  int is_const;      // pointers: the pointee is const
  int pointee_kind;  // pointers: pnc_kind of the pointee (PNC_OTHER for structs, __half...)
  int pointee_size;  // pointers: sizeof the pointee (0 for void)
  const char* type;  // pointers: the pointee's type name as the harness knows it ("float", "__half"...)
};

// one kernel of a module: its name expression, launch bound and how to call it
struct pnc_kernel {
  const char* name;              // the name expression, e.g. "pynorm::layer_norm_fwd<float, float>"
  int max_threads;               // __launch_bounds__ maximum threads per block (1024 without one)
  int min_blocks;                // __launch_bounds__ minimum blocks per SM (0 without one)
  int nparams;
  const pnc_param* params;
  void (*invoke)(void** slots);  // calls the kernel with parameter i read from slots[i]
};

// what a module exports (pnc_module_info): its kernels and its dynamic shared memory arrays
struct pnc_dynamic_smem {
  unsigned char* data;
  size_t size;
};
struct pnc_module {
  int nkernels;
  const pnc_kernel* kernels;
  int ndynamic;
  void (*dynamic_smem)(pnc_dynamic_smem* out);  // the calling thread's dynamic shared memory arrays
  void* (*tls_anchor)();  // touches the module's thread-local (shared memory) block, returns an address in it
};

}  // extern "C"
