//! A loaded llama.cpp model and its vocabulary.

use std::ffi::{c_char, CString};
use std::path::{Path, PathBuf};

use llama_cpp_sys_2 as sys;

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use crate::{Error, Reservation, Result, RpcDevice};

/// A token id.
pub type Token = i32;

/// How to load a model. Loading always maps the file (`LLAMA_LOAD_MODE_MMAP`, so the runtime can
/// find and rebind tensors that point into the mapping) and never uses extra buffer types
/// (`use_extra_bufts = false`: repacked CPU buffers hold an interleaved layout, not the file's
/// bytes, so a streamed slice would be wrong; the resident reference run loads the same way).
#[derive(Debug, Clone, Default)]
pub struct ModelParams {
    /// Layers to offload to a GPU (0 on CPU-only builds).
    pub n_gpu_layers: i32,
    /// Tensors whose names match this regular expression are kept out of the load-time
    /// prefetch (vendor patch 0002): no `MAP_POPULATE` over them, `MADV_RANDOM` on their ranges,
    /// nothing read until touched. `None` keeps llama.cpp's stock behaviour (the whole file is
    /// populated at load).
    pub lazy_tensor_pattern: Option<String>,
    /// Tensors whose names match this regular expression stay in CPU memory even in offloaded
    /// layers (`tensor_buft_overrides` to the CPU buffer type), so a GPU build still streams
    /// them. `None`: llama.cpp places every tensor of an offloaded layer on the GPU.
    pub cpu_tensor_pattern: Option<String>,
    /// Read only the metadata and simulate every allocation (`no_alloc`): no weight is read or
    /// allocated, and contexts over the model report the sizes they would hold
    /// ([`crate::Context::memory_sizes`]) without computing anything.
    pub metadata_only: bool,
    /// Integer metadata values to use instead of the file's (`kv_overrides`), e.g.
    /// `("gpt-oss.expert_used_count", 2)`. Keys are at most 127 bytes.
    pub int_overrides: Vec<(String, i64)>,
    /// Layers to place on RPC workers, resident there (`None`: every layer stays here).
    pub rpc: Option<RpcSplit>,
    /// Read the tensors llama.cpp loads itself (those `lazy_tensor_pattern` leaves out) with
    /// O_DIRECT (`LLAMA_LOAD_MODE_DIRECT_IO`) instead of through the file mapping, so none of
    /// their pages stay in the page cache: an RPC head uploading its workers' layers. The lazy
    /// tensors are still mapped.
    pub direct_io: bool,
}

/// Which of a model's layers RPC workers hold: the last `layers.iter().sum()` repeating layers,
/// `layers[i]` of them on `devices[i]` in order, and the output layer on the last device
/// (llama.cpp offloads a contiguous range that ends with the output layer).
#[derive(Debug, Clone)]
pub struct RpcSplit {
    /// The workers, in layer order.
    pub devices: Vec<RpcDevice>,
    /// Repeating layers per worker.
    pub layers: Vec<u32>,
}

/// llama.cpp's metadata overrides for `ints`, ended by an entry with an empty key (empty when
/// there is nothing to override).
fn kv_overrides(ints: &[(String, i64)]) -> Result<Vec<sys::llama_model_kv_override>> {
    if ints.is_empty() {
        return Ok(Vec::new());
    }
    let entry = |key: &str, value: i64| -> Result<sys::llama_model_kv_override> {
        let mut k = [0 as c_char; 128];
        if key.len() >= k.len() || key.contains('\0') {
            return Err(Error::MetadataOverride(key.to_string()));
        }
        for (dst, &b) in k.iter_mut().zip(key.as_bytes()) {
            *dst = b as c_char;
        }
        Ok(sys::llama_model_kv_override {
            tag: sys::LLAMA_KV_OVERRIDE_TYPE_INT,
            key: k,
            __bindgen_anon_1: sys::llama_model_kv_override__bindgen_ty_1 { val_i64: value },
        })
    };
    let mut out = ints.iter().map(|(k, v)| entry(k, *v)).collect::<Result<Vec<_>>>()?;
    out.push(entry("", 0)?);
    Ok(out)
}

/// A loaded model. Read-only after load (except for weights rebound by the streaming engine);
/// contexts borrow it.
pub struct Model {
    raw: *mut sys::llama_model,
    path: PathBuf,
    /// Memory that weight tensors were rebound to; freed only after the model.
    rebound: Mutex<Vec<Arc<Reservation>>>,
    /// The threads running a decode over this model now, all contexts together (the decode
    /// gate [`Model::while_no_other_decode`] holds).
    decoding: Mutex<Vec<std::thread::ThreadId>>,
    /// The RPC workers holding some of its layers.
    rpc: Vec<RpcDevice>,
}

// SAFETY: a llama_model is immutable after llama_model_load_from_file returns; llama.cpp supports
// several contexts (and threads) over one model.
unsafe impl Send for Model {}
// SAFETY: as above, all access through &Model is read-only.
unsafe impl Sync for Model {}

impl Model {
    /// Loads `path` (the first file of a split model names the rest).
    pub fn load(path: &Path, params: &ModelParams) -> Result<Model> {
        crate::init();
        let c_path = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| Error::PathNul(path.into()))?;
        // SAFETY: returns a plain struct of defaults.
        let mut p = unsafe { sys::llama_model_default_params() };
        // A metadata-only load maps nothing (llama.cpp requires it): it reads no weight anyway.
        p.load_mode = match (params.metadata_only, params.direct_io) {
            (true, _) => sys::LLAMA_LOAD_MODE_NONE,
            (false, true) => sys::LLAMA_LOAD_MODE_DIRECT_IO,
            (false, false) => sys::LLAMA_LOAD_MODE_MMAP,
        };
        if p.load_mode == sys::LLAMA_LOAD_MODE_MMAP {
            // A page of the mapping the storage cannot read is an error naming the model, not a
            // silent SIGBUS.
            crate::mapping_faults::name_mapped_model(path);
        }
        p.use_extra_bufts = false;
        p.n_gpu_layers = params.n_gpu_layers;
        p.no_alloc = params.metadata_only;
        let pattern = match &params.lazy_tensor_pattern {
            Some(s) => Some(CString::new(s.as_str()).map_err(|e| Error::TextNul(e.nul_position()))?),
            None => None,
        };
        p.lazy_tensor_pattern = pattern.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
        let cpu_pattern = match &params.cpu_tensor_pattern {
            Some(s) => Some(CString::new(s.as_str()).map_err(|e| Error::TextNul(e.nul_position()))?),
            None => None,
        };
        let overrides: Vec<sys::llama_model_tensor_buft_override> = match &cpu_pattern {
            Some(c) => {
                // SAFETY: returns the process-wide CPU buffer type, valid for the whole process.
                let cpu = unsafe { sys::ggml_backend_cpu_buffer_type() };
                vec![
                    sys::llama_model_tensor_buft_override { pattern: c.as_ptr(), buft: cpu },
                    sys::llama_model_tensor_buft_override { pattern: std::ptr::null(), buft: std::ptr::null_mut() },
                ]
            }
            None => Vec::new(),
        };
        if !overrides.is_empty() {
            p.tensor_buft_overrides = overrides.as_ptr();
        }
        let kv = kv_overrides(&params.int_overrides)?;
        if !kv.is_empty() {
            p.kv_overrides = kv.as_ptr();
        }
        let mut devices: Vec<sys::ggml_backend_dev_t> = Vec::new();
        let mut split: Vec<f32> = Vec::new();
        if let Some(rpc) = &params.rpc {
            if rpc.devices.is_empty() || rpc.devices.len() != rpc.layers.len() {
                return Err(Error::RpcSplit { devices: rpc.devices.len(), counts: rpc.layers.len() });
            }
            devices.extend(rpc.devices.iter().map(RpcDevice::raw));
            devices.push(std::ptr::null_mut());
            // llama.cpp reads llama_max_devices() split entries. The workers' cumulative shares
            // are exact layer counts (the output layer counted on the last).
            // SAFETY: a constant of the build.
            let max = unsafe { sys::llama_max_devices() };
            split.resize(max.max(rpc.layers.len()), 0.0);
            for (s, &n) in split.iter_mut().zip(&rpc.layers) {
                *s = n as f32;
            }
            split[rpc.layers.len() - 1] += 1.0;
            p.devices = devices.as_mut_ptr();
            p.tensor_split = split.as_ptr();
            p.split_mode = sys::LLAMA_SPLIT_MODE_LAYER;
            p.n_gpu_layers = rpc.layers.iter().sum::<u32>() as i32 + 1;
        }
        // SAFETY: c_path is NUL-terminated; p is a fully initialized parameter struct whose
        // pointers are the library defaults (NULL), `pattern`, `overrides` (NULL-terminated,
        // its patterns in `cpu_pattern`), `kv` (ended by an empty key), `devices`
        // (NULL-terminated) or `split` (llama_max_devices() entries), all of which outlive the
        // call.
        let raw = unsafe { crate::shim::sluice_model_load_from_file(c_path.as_ptr(), p) };
        let rpc: Vec<RpcDevice> = params.rpc.as_ref().map(|r| r.devices.clone()).unwrap_or_default();
        let caught = crate::shim::caught("llama_model_load_from_file");
        if raw.is_null() {
            // A worker lost during the load is the reason to name.
            crate::rpc::check_connected(&rpc)?;
            caught?;
            return Err(Error::ModelLoad { path: path.into() });
        }
        let model =
            Model { raw, path: path.into(), rebound: Mutex::new(Vec::new()), decoding: Default::default(), rpc };
        caught?;
        // A worker lost during the load leaves its layers without their weights.
        crate::rpc::check_connected(&model.rpc)?;
        model.check_special_tokens()?;
        Ok(model)
    }

    /// The special tokens llama.cpp's tokenizer adds exist (it asserts on a missing one at the
    /// first tokenize): WordPiece adds BOS and SEP, the others BOS and EOS where the vocabulary
    /// asks for them; and there is a tokenizer at all.
    fn check_special_tokens(&self) -> Result<()> {
        let v = self.vocab();
        let n = self.n_vocab() as sys::llama_token;
        // SAFETY: a live vocab; plain getters of loaded values.
        let (ty, bos, eos, sep, add_bos, add_eos) = unsafe {
            (
                sys::llama_vocab_type(v),
                sys::llama_vocab_bos(v),
                sys::llama_vocab_eos(v),
                sys::llama_vocab_sep(v),
                sys::llama_vocab_get_add_bos(v),
                sys::llama_vocab_get_add_eos(v),
            )
        };
        let fail = |message: String| Err(Error::Vocabulary { path: self.path.clone(), message });
        if ty == sys::LLAMA_VOCAB_TYPE_NONE {
            return fail("it has no tokenizer (tokenizer.ggml.model), so no text can be turned into tokens".into());
        }
        let wordpiece = ty == sys::LLAMA_VOCAB_TYPE_WPM;
        let added = [
            ("BOS", "tokenizer.ggml.bos_token_id", bos, add_bos || wordpiece),
            ("EOS", "tokenizer.ggml.eos_token_id", eos, add_eos && !wordpiece),
            ("SEP", "tokenizer.ggml.seperator_token_id", sep, wordpiece),
        ];
        for (what, key, id, needed) in added {
            if needed && !(0..n).contains(&id) {
                return fail(format!(
                    "its tokenizer adds a {what} token to every prompt, but {key} names none of its {n} tokens"
                ));
            }
        }
        Ok(())
    }

    /// `Err` naming the first RPC worker of this model whose connection was lost.
    pub fn check_workers(&self) -> Result<()> {
        crate::rpc::check_connected(&self.rpc)
    }

    /// Counts a decode of this thread over this model until the guard drops.
    pub(crate) fn begin_decode(&self) -> DecodingGuard<'_> {
        self.decoding.lock().unwrap_or_else(|e| e.into_inner()).push(std::thread::current().id());
        DecodingGuard(self)
    }

    /// Runs `f` while no decode of another thread runs over this model, none starting until it
    /// returns; `None` (and `f` not run) when one runs.
    pub(crate) fn while_no_other_decode<R>(&self, f: impl FnOnce() -> R) -> Option<R> {
        let decoding = self.decoding.lock().unwrap_or_else(|e| e.into_inner());
        let me = std::thread::current().id();
        decoding.iter().all(|t| *t == me).then(f)
    }

    /// The address of this model's tensor named `name`, if it has one.
    pub(crate) fn tensor_named(&self, name: &str) -> Option<*const sys::ggml_tensor> {
        let c = std::ffi::CString::new(name).ok()?;
        // SAFETY: a live model; c is NUL-terminated and outlives the call; the shim catches.
        let t = unsafe { crate::shim::sluice_model_tensor(self.raw, c.as_ptr()) };
        let _ = crate::shim::caught("llama_model::get_tensor");
        (!t.is_null()).then_some(t)
    }

    /// Keeps `reservation` alive until the model is freed (a weight now points into it).
    pub(crate) fn keep_alive(&self, reservation: Arc<Reservation>) {
        self.rebound.lock().unwrap_or_else(|e| e.into_inner()).push(reservation);
    }

    pub(crate) fn raw(&self) -> *mut sys::llama_model {
        self.raw
    }

    fn vocab(&self) -> *const sys::llama_vocab {
        // SAFETY: self.raw is a live model; the vocab lives as long as the model.
        unsafe { sys::llama_model_get_vocab(self.raw) }
    }

    /// The file it was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the model's memory can drop its last positions (rejected draft tokens): not for
    /// recurrent or hybrid models, whose state cannot be rolled back.
    pub fn memory_forgets_tail(&self) -> bool {
        // SAFETY: live model.
        unsafe { !sys::llama_model_is_recurrent(self.raw) && !sys::llama_model_is_hybrid(self.raw) }
    }

    /// Number of transformer layers.
    pub fn n_layer(&self) -> u32 {
        // SAFETY: live model.
        unsafe { sys::llama_model_n_layer(self.raw) }.max(0) as u32
    }

    /// Embedding width.
    pub fn n_embd(&self) -> u32 {
        // SAFETY: live model.
        unsafe { sys::llama_model_n_embd(self.raw) }.max(0) as u32
    }

    /// Context length the model was trained with.
    pub fn n_ctx_train(&self) -> u32 {
        // SAFETY: live model.
        unsafe { sys::llama_model_n_ctx_train(self.raw) }.max(0) as u32
    }

    /// Vocabulary size.
    pub fn n_vocab(&self) -> usize {
        // SAFETY: live vocab.
        unsafe { sys::llama_vocab_n_tokens(self.vocab()) }.max(0) as usize
    }

    /// Total bytes of the model's tensors.
    pub fn size_bytes(&self) -> u64 {
        // SAFETY: live model.
        unsafe { sys::llama_model_size(self.raw) }
    }

    /// llama.cpp's one-line description (`qwen3moe ?B F16`).
    pub fn desc(&self) -> String {
        let mut buf = [0 as c_char; 256];
        // SAFETY: buf is writable for its length; llama.cpp NUL-terminates within it.
        let n = unsafe { sys::llama_model_desc(self.raw, buf.as_mut_ptr(), buf.len()) };
        if n < 0 {
            return String::new();
        }
        let bytes: Vec<u8> = buf.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Whether `token` ends generation (end-of-sequence and the like).
    pub fn is_eog(&self, token: Token) -> bool {
        // SAFETY: live vocab; llama.cpp range-checks the token.
        unsafe { sys::llama_vocab_is_eog(self.vocab(), token) }
    }

    /// Tokenizes `text`, adding the model's BOS token where the vocabulary asks for it.
    pub fn tokenize(&self, text: &str, add_special: bool) -> Result<Vec<Token>> {
        self.tokenize_with(text, add_special, false)
    }

    /// [`Model::tokenize`], with control-token text parsed as control tokens when
    /// `parse_special` is set (for prompts made by a chat template).
    pub fn tokenize_with(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<Token>> {
        self.tokenize_until(text, add_special, parse_special, None)
    }

    /// [`Model::tokenize_with`] that stops with [`Error::TokenizeCancelled`] soon after
    /// `cancel` is set (from another thread): llama.cpp's tokenizers check it as they go
    /// (vendor patch 0011), so a prompt whose request went away is not finished for nothing.
    pub fn tokenize_cancellable(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
        cancel: &AtomicBool,
    ) -> Result<Vec<Token>> {
        self.tokenize_until(text, add_special, parse_special, Some(cancel))
    }

    fn tokenize_until(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
        cancel: Option<&AtomicBool>,
    ) -> Result<Vec<Token>> {
        let abort = cancel.map_or(std::ptr::null(), |c| c.as_ptr().cast_const()).cast::<u8>();
        let len = i32::try_from(text.len())
            .map_err(|_| Error::Tokenize(format!("text of {} bytes is too long", text.len())))?;
        let mut tokens: Vec<Token> = vec![0; text.len() + 2];
        for _ in 0..2 {
            // SAFETY: text is valid for len bytes (no NUL needed: the length is passed); tokens
            // is writable for tokens.len() entries; abort is NULL or points at the borrowed
            // cancel flag, which outlives the call, read there only with atomic loads (an
            // AtomicBool is one byte, 0 or 1), and the shim clears it before returning.
            let n = unsafe {
                crate::shim::sluice_tokenize(
                    self.vocab(),
                    text.as_ptr().cast(),
                    len,
                    tokens.as_mut_ptr(),
                    tokens.len() as i32,
                    add_special,
                    parse_special,
                    abort,
                )
            };
            if let Err(e) = crate::shim::caught("llama_tokenize") {
                return Err(match cancel {
                    Some(c) if c.load(std::sync::atomic::Ordering::Relaxed) => Error::TokenizeCancelled,
                    _ => e,
                });
            }
            if n >= 0 {
                tokens.truncate(n as usize);
                return Ok(tokens);
            }
            if n == i32::MIN {
                return Err(Error::Tokenize("token count overflows i32".into()));
            }
            tokens.resize((-n) as usize, 0);
        }
        Err(Error::Tokenize("llama_tokenize kept asking for a larger buffer".into()))
    }

    /// The longest text any token of the vocabulary stands for, in bytes (control tokens as
    /// their text, which a chat template's prompt spells out).
    pub fn max_token_bytes(&self) -> usize {
        let mut buf = vec![0u8; 256];
        (0..self.n_vocab() as Token)
            .filter_map(|token| self.piece_into(token, &mut buf, true).ok())
            .map(|n| n.unsigned_abs() as usize)
            .max()
            .unwrap_or(0)
    }

    /// The bytes a token stands for (byte tokens give single raw bytes, so a piece can be part
    /// of a UTF-8 sequence). Control tokens give nothing, and so does a token llama.cpp cannot
    /// render (logged).
    pub fn token_piece(&self, token: Token) -> Vec<u8> {
        self.token_piece_with(token, false)
    }

    /// [`Model::token_piece`], with control tokens' text too when `special` (the chat parsers
    /// need to see some of them, e.g. gpt-oss's `<|channel|>`).
    pub fn token_piece_with(&self, token: Token, special: bool) -> Vec<u8> {
        let mut buf = vec![0u8; 32];
        for _ in 0..2 {
            match self.piece_into(token, &mut buf, special) {
                Ok(n) if n >= 0 => {
                    buf.truncate(n as usize);
                    return buf;
                }
                Ok(n) => buf.resize(n.unsigned_abs() as usize, 0),
                Err(_) => return Vec::new(),
            }
        }
        Vec::new()
    }

    /// Writes `token`'s text into `buf` (control tokens' too when `special`): its length, or
    /// the negated length needed when `buf` is too short. A token llama.cpp cannot render is
    /// logged and an error.
    fn piece_into(&self, token: Token, buf: &mut [u8], special: bool) -> Result<i32> {
        let len = i32::try_from(buf.len()).unwrap_or(i32::MAX);
        // SAFETY: buf is writable for len bytes; llama.cpp writes at most `length` bytes and
        // returns the negated size needed when that is too short.
        let n = unsafe {
            crate::shim::sluice_token_to_piece(self.vocab(), token, buf.as_mut_ptr().cast(), len, 0, special)
        };
        crate::shim::caught("llama_token_to_piece").inspect_err(|e| log::warn!("token {token}: {e}"))?;
        Ok(n)
    }
}

/// A decode over a model, counted while it runs.
pub(crate) struct DecodingGuard<'a>(&'a Model);

impl Drop for DecodingGuard<'_> {
    fn drop(&mut self) {
        let mut decoding = self.0.decoding.lock().unwrap_or_else(|e| e.into_inner());
        let me = std::thread::current().id();
        if let Some(i) = decoding.iter().position(|t| *t == me) {
            decoding.swap_remove(i);
        }
    }
}

impl Drop for Model {
    fn drop(&mut self) {
        // SAFETY: raw came from llama_model_load_from_file; contexts borrow the model, so none
        // outlives it; freed exactly once. The rebound reservations drop after this body.
        unsafe { sys::llama_model_free(self.raw) };
    }
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model").field("path", &self.path).finish()
    }
}
