// Catching shims: the llama.cpp entry points that can throw a C++ exception (a malformed
// vocabulary's std::out_of_range, a std::bad_alloc for absurd sizes, ...), wrapped so that no
// exception unwinds into Rust, which would abort the process. Each returns what the wrapped
// function returns, or a neutral value after an exception, whose message is then kept for this
// thread until sluice_shim_take_error() collects it.

#include "llama.h"
#include "gguf.h"
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

int32_t sluice_tokenize(const struct llama_vocab * vocab, const char * text, int32_t text_len, llama_token * tokens,
                        int32_t n_tokens_max, bool add_special, bool parse_special) {
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

}  // extern "C"
