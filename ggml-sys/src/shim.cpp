// Catching shims: the llama.cpp and ggml entry points that can throw a C++ exception (a malformed
// vocabulary's std::out_of_range, a std::bad_alloc for absurd sizes, ...), wrapped so that no
// exception unwinds into Rust, which would abort the process. Each returns what the wrapped
// function returns, or a neutral value after an exception, whose message is then kept for this
// thread until sluice_shim_take_error() collects it.

#include "llama.h"
#include "gguf.h"
#include "ggml-backend.h"
#include "ggml-ext.h"
#include "ggml-rpc.h"
#include "llama-model.h"
#include "shim.h"

#include <string>

namespace {
thread_local std::string g_error;
thread_local bool g_failed = false;
}  // namespace

extern "C" {

void sluice_shim_record(const char * what) {
    g_failed = true;
    try {
        g_error = what;
    } catch (...) {
        g_error.clear();
    }
}

// Whether the last shimmed call on this thread threw; its message is copied into buf (at most
// len bytes, NUL-terminated) and the record is cleared.
bool sluice_shim_take_error(char * buf, size_t len) {
    if (!g_failed) {
        return false;
    }
    g_failed = false;
    if (len > 0) {
        size_t n = g_error.size() < len - 1 ? g_error.size() : len - 1;
        g_error.copy(buf, n);
        buf[n] = '\0';
    }
    return true;
}

struct gguf_context * sluice_gguf_init_from_file(const char * fname, struct gguf_init_params params) {
    try {
        return gguf_init_from_file(fname, params);
    }
    SLUICE_CATCH(nullptr)
}

struct llama_model * sluice_model_load_from_file(const char * path, struct llama_model_params params) {
    try {
        return llama_model_load_from_file(path, params);
    }
    SLUICE_CATCH(nullptr)
}

struct llama_context * sluice_init_from_model(struct llama_model * model, struct llama_context_params params) {
    try {
        return llama_init_from_model(model, params);
    }
    SLUICE_CATCH(nullptr)
}

int32_t sluice_decode(struct llama_context * ctx, struct llama_batch batch) {
    try {
        return llama_decode(ctx, batch);
    }
    SLUICE_CATCH(-1)
}

// Vendor patch 0011: the tokenizers of this thread stop (throwing) once *flag is non-zero.
extern "C" void sluice_tokenize_set_abort(const unsigned char * flag);

// llama_tokenize, stopping with an exception once *abort (when not NULL) is set.
int32_t sluice_tokenize(const struct llama_vocab * vocab, const char * text, int32_t text_len, llama_token * tokens,
                        int32_t n_tokens_max, bool add_special, bool parse_special, const unsigned char * abort) {
    // Cleared however the call ends: the flag must not outlive the borrow it came from.
    struct ClearAbort {
        ~ClearAbort() { sluice_tokenize_set_abort(nullptr); }
    } clear;
    sluice_tokenize_set_abort(abort);
    try {
        return llama_tokenize(vocab, text, text_len, tokens, n_tokens_max, add_special, parse_special);
    }
    SLUICE_CATCH(0)
}

int32_t sluice_token_to_piece(const struct llama_vocab * vocab, llama_token token, char * buf, int32_t length,
                              int32_t lstrip, bool special) {
    try {
        return llama_token_to_piece(vocab, token, buf, length, lstrip, special);
    }
    SLUICE_CATCH(0)
}

// Connects to the RPC server at endpoint (vendor patch 0007 makes a failed connection a return,
// not an abort): its first device, with its buffer type created while the server answers (ggml
// keeps the buffer type, alignment included, for the process), or NULL with the reason recorded.
ggml_backend_dev_t sluice_rpc_connect(const char * endpoint) {
    try {
        ggml_backend_rpc_reconnect(endpoint);
        ggml_backend_reg_t reg = ggml_backend_rpc_add_server(endpoint);
        if (reg == nullptr || ggml_backend_reg_dev_count(reg) == 0) {
            sluice_shim_record("no RPC server answers there (refused, unreachable or not a ggml RPC server)");
            return nullptr;
        }
        ggml_backend_dev_t dev = ggml_backend_reg_dev_get(reg, 0);
        size_t free = 0;
        size_t total = 0;
        ggml_backend_rpc_get_device_memory(endpoint, 0, &free, &total);
        if (ggml_backend_rpc_server_lost(endpoint) || ggml_backend_dev_buffer_type(dev) == nullptr) {
            sluice_shim_record("the RPC server stopped answering");
            return nullptr;
        }
        return dev;
    }
    SLUICE_CATCH(nullptr)
}

// The free and total memory the RPC server at endpoint reports (reconnecting when the last
// connection was lost); false, with a reason recorded, when it does not answer.
bool sluice_rpc_memory(const char * endpoint, uint64_t * free, uint64_t * total) {
    try {
        ggml_backend_rpc_reconnect(endpoint);
        size_t f = 0;
        size_t t = 0;
        ggml_backend_rpc_get_device_memory(endpoint, 0, &f, &t);
        if (ggml_backend_rpc_server_lost(endpoint)) {
            sluice_shim_record("the RPC server does not answer");
            return false;
        }
        *free = f;
        *total = t;
        return true;
    }
    SLUICE_CATCH(false)
}

// Serves this process's CPU device over RPC at endpoint with opts (vendor patch 0009: limits
// and the accept hook). Returns only when the server cannot start (false) or throws (false, the
// exception recorded).
bool sluice_rpc_serve(const char * endpoint, const char * cache_dir, size_t n_threads,
                      const struct ggml_backend_rpc_server_opts * opts) {
    try {
        ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
        if (cpu == nullptr) {
            sluice_shim_record("this build has no CPU backend");
            return false;
        }
        ggml_backend_dev_t devices[1] = { cpu };
        return ggml_backend_rpc_serve_opts(endpoint, cache_dir, n_threads, 1, devices, opts);
    }
    SLUICE_CATCH(false)
}

// The tensor of `model` named `name` (llama.cpp's own lookup over the tensors it loaded), or
// NULL when the model has none of that name.
const struct ggml_tensor * sluice_model_tensor(const struct llama_model * model, const char * name) {
    try {
        return model->get_tensor(name);
    }
    SLUICE_CATCH(nullptr)
}

// The operator-extension registry and the scheduler (vendor patch 0005 and ggml-backend): C
// entry points implemented in C++ over std containers (std::bad_alloc, ...).

ggml_ext_op_t sluice_ext_register_op(const struct ggml_ext_op_desc * desc) {
    try {
        return ggml_ext_register_op(desc);
    }
    SLUICE_CATCH(nullptr)
}

ggml_ext_op_t sluice_ext_find_op(const char * name) {
    try {
        return ggml_ext_find_op(name);
    }
    SLUICE_CATCH(nullptr)
}

struct ggml_tensor * sluice_ext_op_create(struct ggml_context * ctx, ggml_ext_op_t op, struct ggml_tensor ** srcs,
                                          int n_srcs, const void * attrs) {
    try {
        return ggml_ext_op_create(ctx, op, srcs, n_srcs, attrs);
    }
    SLUICE_CATCH(nullptr)
}

bool sluice_ext_register_kernel(ggml_backend_dev_t device, const struct ggml_ext_kernel_desc * desc) {
    try {
        return ggml_ext_register_kernel(device, desc);
    }
    SLUICE_CATCH(false)
}

ggml_backend_sched_t sluice_sched_new(ggml_backend_t * backends, ggml_backend_buffer_type_t * bufts, int n_backends,
                                      size_t graph_size, bool parallel, bool op_offload) {
    try {
        return ggml_backend_sched_new(backends, bufts, n_backends, graph_size, parallel, op_offload);
    }
    SLUICE_CATCH(nullptr)
}

bool sluice_sched_reserve(ggml_backend_sched_t sched, struct ggml_cgraph * graph) {
    try {
        return ggml_backend_sched_reserve(sched, graph);
    }
    SLUICE_CATCH(false)
}

bool sluice_sched_alloc_graph(ggml_backend_sched_t sched, struct ggml_cgraph * graph) {
    try {
        return ggml_backend_sched_alloc_graph(sched, graph);
    }
    SLUICE_CATCH(false)
}

enum ggml_status sluice_sched_graph_compute(ggml_backend_sched_t sched, struct ggml_cgraph * graph) {
    try {
        return ggml_backend_sched_graph_compute(sched, graph);
    }
    SLUICE_CATCH(GGML_STATUS_FAILED)
}

}  // extern "C"
