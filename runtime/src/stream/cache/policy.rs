//! The cache policies a run can choose.

/// Which resident expert goes first when room is needed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CachePolicy {
    /// Least recently used.
    Lru,
    /// Least often routed, each routing's weight halving every 4 decodes: an expert routed in
    /// many recent tokens stays over one routed once, and one that stops being routed ages out.
    /// Ties go to the least recently used.
    Frequency,
    /// Frequency at the half-life that has been hitting lately, with admission: the cache
    /// replays each of six half-lives (a quarter of a decode to 256 decodes) on ghost caches
    /// (bookkeeping only) and ranks by the one whose ghost hit most lately (a window with a
    /// half-life of 16 decodes), as ARC weighs recency against frequency by its ghosts' hits;
    /// and a routed expert that ranks below the one it would evict is read, used and given back
    /// instead of evicting it, as TinyLFU admits (where the layer can pass experts through).
    Adaptive,
}

impl CachePolicy {
    /// Every policy, for comparisons (`sluice replay`, `bench --trace`).
    pub const ALL: [CachePolicy; 3] = [CachePolicy::Lru, CachePolicy::Frequency, CachePolicy::Adaptive];

    /// The policy a run uses where neither its profile nor its command line names one.
    pub const DEFAULT: CachePolicy = CachePolicy::Adaptive;

    /// The policy's name as the command line and the profiles spell it.
    pub fn name(self) -> &'static str {
        match self {
            CachePolicy::Lru => "lru",
            CachePolicy::Frequency => "frequency",
            CachePolicy::Adaptive => "adaptive",
        }
    }
}

impl std::fmt::Display for CachePolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

// `--help` shows the frequency policy's doc comment, which names `HALF_LIFE_DECODES`' value.
const _: () = assert!(super::HALF_LIFE_DECODES == 4, "CachePolicy::Frequency's doc names the half-life");
