//! Tensor types per role: what ggml's CPU kernels can compute with each tensor a graph uses.

use ggml_sys::{GgmlType, GgufFile, GgufTensor};

use super::MetadataError;

/// What a tensor is to the graph, as its name and shape say.
#[derive(Debug, PartialEq, Eq)]
enum Role {
    /// Norm weights, biases, attention sinks and other vectors: added or multiplied
    /// element-wise in F32 (ggml's binary ops, soft_max's sinks and the norms assert F32; the
    /// converters store them so).
    Vector,
    /// Weight matrices (and expert stacks, and the token embeddings): multiplied or gathered.
    Matrix,
}

/// The role of `t`.
fn role(t: &GgufTensor) -> Role {
    let base = t.name.rsplit_once('.').map_or(t.name.as_str(), |(base, _)| base);
    let vector_name = t.name.ends_with(".bias")
        || base.ends_with("norm")
        || base.contains("_norm")
        || base.ends_with("attn_sinks")
        || base.ends_with("exp_probs_b");
    let one_dimensional = t.ne[1..].iter().all(|&n| n == 1);
    if vector_name || one_dimensional {
        Role::Vector
    } else {
        Role::Matrix
    }
}

/// Every tensor's type fits its role: vectors F32, matrices a type the CPU multiplies.
pub(super) fn check(gguf: &GgufFile) -> Result<(), MetadataError> {
    for t in gguf.tensors() {
        match role(t) {
            Role::Vector if t.ty != GgmlType::F32 => {
                return Err(MetadataError::new(
                    format!("tensor {}", t.name),
                    format!("is {}; norms, biases and other vectors must be f32 (re-convert the model)", t.ty),
                ))
            }
            Role::Matrix if !t.ty.has_cpu_matmul() => {
                return Err(MetadataError::new(
                    format!("tensor {}", t.name),
                    format!("is {}, a type ggml cannot multiply; weight matrices are float or quantized types", t.ty),
                ))
            }
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(name: &str, ne: [i64; 4]) -> GgufTensor {
        GgufTensor { name: name.into(), offset: 0, size: 0, ty: GgmlType::F32, ne }
    }

    #[test]
    fn roles_by_name_and_shape() {
        assert_eq!(role(&tensor("blk.0.attn_norm.weight", [64, 1, 1, 1])), Role::Vector);
        assert_eq!(role(&tensor("blk.0.ffn_down_exps.bias", [64, 8, 1, 1])), Role::Vector);
        assert_eq!(role(&tensor("blk.0.attn_q_a_norm.weight", [64, 1, 1, 1])), Role::Vector);
        assert_eq!(role(&tensor("blk.0.attn_sinks.weight", [8, 1, 1, 1])), Role::Vector);
        assert_eq!(role(&tensor("blk.0.ffn_up_exps.weight", [64, 32, 8, 1])), Role::Matrix);
        assert_eq!(role(&tensor("token_embd.weight", [64, 512, 1, 1])), Role::Matrix);
    }
}
