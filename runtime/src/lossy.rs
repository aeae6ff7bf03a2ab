//! Opt-in lossy modes: settings that make streaming cheaper by changing what the model computes.
//! Both are off unless asked for; every run summary, `/metrics` and bench row says which are on,
//! and `sluice bench` measures what each costs in quality ([`Agreement`]).
//!
//! - Fewer experts per token (`--experts-used K`): llama.cpp routes each token to its `K` best
//!   experts instead of the model's count (the file's `expert_used_count`, overridden at load),
//!   so a token reads and computes `K / k` of the experts.
//! - Cache-aware substitution (`--substitute N`): when one of a token's chosen experts is not in
//!   the expert cache, and a cached expert is among the `N` the router ranked right after the
//!   token's chosen ones, the cached one runs instead (weighted by its own router score). The
//!   margin is a number of router ranks, not a score difference: router scores are softmax
//!   probabilities in one architecture, sigmoid scores or raw logits in others, while the rank
//!   means the same in all of them.

/// The lossy settings of a run (both `None`: exact).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Lossy {
    /// Route each token to this many experts instead of the model's count.
    pub experts_used: Option<u32>,
    /// Substitute a cached expert ranked within this many places after a token's chosen
    /// experts for a chosen one the cache misses.
    pub substitute: Option<u32>,
}

/// A lossy setting the model cannot take.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LossyError {
    /// `--experts-used` outside `1..=` the model's count.
    #[error(
        "--experts-used {asked}: the model routes each token to {model} experts; give 1 to {model} (fewer is the lossy speed-up; the model's own count is exact)"
    )]
    ExpertsUsed {
        /// What was asked.
        asked: u32,
        /// The model's count.
        model: u32,
    },
    /// `--substitute 0`.
    #[error(
        "--substitute 0 substitutes nothing; give the number of router ranks (1 or more) a substitute may come from"
    )]
    Substitute,
}

impl Lossy {
    /// A bench row's label suffix (`, LOSSY ...`, which [`crate::bench::BenchRow::is_lossy`]
    /// looks for; empty for an exact row), of a model that routes `model_used` experts a token.
    pub fn row_label(&self, model_used: u32) -> String {
        match (self.experts_used, self.substitute) {
            (Some(k), _) => format!(", LOSSY {k} of {model_used} experts"),
            (None, Some(n)) => format!(", LOSSY substitute from {n} ranks"),
            (None, None) => String::new(),
        }
    }

    /// Whether nothing lossy is on.
    pub fn is_exact(&self) -> bool {
        self.experts_used.is_none() && self.substitute.is_none()
    }

    /// Checks the settings against a model routing `model_used` experts per token.
    pub fn check(&self, model_used: u32) -> Result<(), LossyError> {
        if let Some(k) = self.experts_used {
            if k == 0 || k > model_used {
                return Err(LossyError::ExpertsUsed { asked: k, model: model_used });
            }
        }
        if self.substitute == Some(0) {
            return Err(LossyError::Substitute);
        }
        Ok(())
    }

    /// The metadata overrides that load the model with these settings (architecture `arch`).
    pub fn model_overrides(&self, arch: &str) -> Vec<(String, i64)> {
        self.experts_used.map(|k| (format!("{arch}.expert_used_count"), i64::from(k))).into_iter().collect()
    }

    /// A one-line description for summaries and logs (`model_used`: the model's count).
    pub fn describe(&self, model_used: u32) -> String {
        let mut parts = Vec::new();
        if let Some(k) = self.experts_used {
            parts.push(format!("{k} of {model_used} experts per token"));
        }
        if let Some(n) = self.substitute {
            parts.push(format!("cached experts substituted from the next {n} router ranks"));
        }
        if parts.is_empty() {
            "exact (no lossy mode)".to_string()
        } else {
            format!("LOSSY: {}", parts.join("; "))
        }
    }
}

/// How closely a lossy run's next-token distributions follow the exact run's over the same
/// text (the exact run's tokens fed to both).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Agreement {
    /// Positions compared.
    pub steps: usize,
    /// Share of positions where both put the same token first.
    pub top1: f64,
    /// Mean Kullback-Leibler divergence KL(exact ‖ lossy) of the next-token distributions, nats.
    pub mean_kl: f64,
}

/// `logits` as log-probabilities (a numerically stable log-softmax).
fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    let log_sum = sum.ln() + max;
    logits.iter().map(|&l| l as f64 - log_sum).collect()
}

/// The index of the largest logit (the lowest index among equals, as greedy sampling takes).
fn argmax(logits: &[f32]) -> usize {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best
}

/// Accumulates [`Agreement`] position by position.
#[derive(Debug, Default)]
pub struct AgreementMeter {
    steps: usize,
    same_top1: usize,
    kl_sum: f64,
}

impl AgreementMeter {
    /// Adds one position: the exact and the lossy logits over the same vocabulary.
    pub fn add(&mut self, exact: &[f32], lossy: &[f32]) {
        let (p, q) = (log_softmax(exact), log_softmax(lossy));
        let kl: f64 = p.iter().zip(&q).map(|(lp, lq)| lp.exp() * (lp - lq)).sum();
        self.kl_sum += kl.max(0.0);
        self.same_top1 += usize::from(argmax(exact) == argmax(lossy));
        self.steps += 1;
    }

    /// The agreement so far.
    pub fn finish(&self) -> Agreement {
        if self.steps == 0 {
            return Agreement::default();
        }
        Agreement {
            steps: self.steps,
            top1: self.same_top1 as f64 / self.steps as f64,
            mean_kl: self.kl_sum / self.steps as f64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identical_distributions_agree_fully_and_others_cost_their_divergence() {
        let mut m = AgreementMeter::default();
        m.add(&[1.0, 2.0, 3.0], &[1.0, 2.0, 3.0]);
        assert_eq!(m.finish(), Agreement { steps: 1, top1: 1.0, mean_kl: 0.0 });
        // Two tokens, exact 50/50 (logits equal) vs lossy e/(1+e) on the second: KL by hand.
        let mut m = AgreementMeter::default();
        m.add(&[0.0, 0.0], &[0.0, 1.0]);
        let q1 = 1.0f64.exp() / (1.0 + 1.0f64.exp());
        let want = 0.5 * (0.5 / (1.0 - q1)).ln() + 0.5 * (0.5 / q1).ln();
        let a = m.finish();
        assert!((a.mean_kl - want).abs() < 1e-9, "{} vs {want}", a.mean_kl);
        assert_eq!(a.top1, 0.0, "exact's first is token 0 (ties to the lower id), lossy's token 1");
    }

    #[test]
    fn settings_are_checked_against_the_model_and_described() {
        let exact = Lossy::default();
        assert!(exact.is_exact());
        assert!(exact.model_overrides("qwen3moe").is_empty());
        assert_eq!(exact.describe(8), "exact (no lossy mode)");
        let fewer = Lossy { experts_used: Some(4), substitute: Some(2) };
        assert_eq!(fewer.check(8), Ok(()));
        assert_eq!(fewer.model_overrides("gpt-oss"), vec![("gpt-oss.expert_used_count".to_string(), 4)]);
        assert!(fewer.describe(8).starts_with("LOSSY: 4 of 8 experts per token"));
        let err = Lossy { experts_used: Some(9), substitute: None }.check(8).unwrap_err();
        assert!(err.to_string().contains("--experts-used 9") && err.to_string().contains("1 to 8"), "{err}");
        assert_eq!(Lossy { experts_used: None, substitute: Some(0) }.check(8), Err(LossyError::Substitute));
    }
}
