"""Writes trained parameters as a qwen3moe GGUF that the pinned llama.cpp loads unchanged.

Tensors take llama.cpp's names and layouts (a GGUF's dimensions are numpy's reversed: a linear
map y = x @ W of (in, out) is stored as W.T, shape (out, in)); the tokenizer, a ChatML template
and the architecture's hyper-parameters go in the metadata. f32 throughout: `sluice quantize`
makes the smaller types from it.
"""

import gguf
import numpy as np

from tokenizer import END_OF_TEXT

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def write(path, cfg, params, vocab, name):
    """Writes the model to `path`."""
    tokens, types, merges = vocab
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_name(name)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_block_count(cfg.layers)
    w.add_context_length(cfg.ctx)
    w.add_embedding_length(cfg.embd)
    w.add_feed_forward_length(cfg.expert_ff)
    w.add_expert_feed_forward_length(cfg.expert_ff)
    w.add_head_count(cfg.heads)
    w.add_head_count_kv(cfg.kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_base)
    w.add_layer_norm_rms_eps(cfg.eps)
    w.add_expert_count(cfg.experts)
    w.add_expert_used_count(cfg.experts_used)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    eot = tokens.index(END_OF_TEXT)
    w.add_bos_token_id(eot)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(eot)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    def put(tensor_name, array):
        w.add_tensor(tensor_name, np.ascontiguousarray(np.asarray(array, dtype=np.float32)))

    put("token_embd.weight", params["embed"])
    for i, p in enumerate(params["layers"]):
        b = f"blk.{i}."
        put(b + "attn_norm.weight", p["attn_norm"])
        put(b + "attn_q.weight", np.asarray(p["wq"]).T)
        put(b + "attn_k.weight", np.asarray(p["wk"]).T)
        put(b + "attn_v.weight", np.asarray(p["wv"]).T)
        put(b + "attn_output.weight", np.asarray(p["wo"]).T)
        put(b + "attn_q_norm.weight", p["q_norm"])
        put(b + "attn_k_norm.weight", p["k_norm"])
        put(b + "ffn_norm.weight", p["ffn_norm"])
        put(b + "ffn_gate_inp.weight", np.asarray(p["router"]).T)
        put(b + "ffn_gate_exps.weight", np.asarray(p["gate"]).transpose(0, 2, 1))
        put(b + "ffn_up_exps.weight", np.asarray(p["up"]).transpose(0, 2, 1))
        put(b + "ffn_down_exps.weight", np.asarray(p["down"]).transpose(0, 2, 1))
    put("output_norm.weight", params["out_norm"])
    put("output.weight", np.asarray(params["output"]).T)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
