//go:build cgo

// rmm_torch_alloc: rmm_alloc for PyTorch's CUDAPluggableAllocator. PyTorch takes whatever its
// alloc function returns as the allocation, NULL included: a NULL for a refused request would
// become a tensor at address 0 and, at its first use, an illegal memory access that ends the CUDA
// context. So a refusal here throws instead, a std::bad_alloc whose what() is the library's
// message; PyTorch lets the C++ exception through to Python, where it is raised as an error with
// that message (as librmm's own PyTorch allocator does, whose out_of_memory is a std::bad_alloc).

#include <cstddef>
#include <new>
#include <string>

extern "C" {
void* rmm_alloc(size_t size, int device, void* stream);
char* rmm_last_error(void);
}

namespace {

class rmm_out_of_memory : public std::bad_alloc {
 public:
  explicit rmm_out_of_memory(std::string msg) : msg_(std::move(msg)) {}
  const char* what() const noexcept override { return msg_.c_str(); }

 private:
  std::string msg_;
};

}  // namespace

extern "C" void* rmm_torch_alloc(size_t size, int device, void* stream) {
  void* p = rmm_alloc(size, device, stream);
  if (p == nullptr && size != 0) {
    // The message of this thread's failure, copied before anything else can replace it.
    const char* e = rmm_last_error();
    throw rmm_out_of_memory(e != nullptr ? std::string(e) : std::string("rmm_torch_alloc: rmm_alloc failed"));
  }
  return p;
}
