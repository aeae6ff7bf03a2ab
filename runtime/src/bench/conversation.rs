//! The benchmark's conversation rows: a five-turn chat (each turn ~300 new tokens after the last
//! answer, fewer where the model's context is shorter) computed from an empty slot every turn, in one slot that keeps whole prompt batches,
//! and in one that keeps any shared prefix (lossy); the sixth turn warm and again after a restart that reads the saved slot back; and 1, 2 or 4
//! clients generating at once. Each row's time to first token counts from the request (the model
//! already open), so the turns compare with each other.

use std::ops::ControlFlow;
use std::time::Duration;

use ggml_sys::Token;

use super::{drop_cached, BenchRow};
use crate::generate::{Chosen, Client, GenerateError, Generation, Reuse, Run, Sampler, SlotUse};
use crate::launch::{Launch, LaunchError, Positions};
use crate::stream::{StreamedSession, TokenRow};
use crate::telemetry::Summary;
use crate::units::mib;

/// Turns in the chat (a sixth is the restart's).
pub const TURNS: usize = 5;
/// New tokens each turn adds after the last answer (at most: a model with a shorter context gets
/// shorter turns).
pub const TURN_TOKENS: usize = 300;
/// The shortest turn worth measuring: a model whose context cannot hold six turns of it skips the
/// chat rows.
const MIN_TURN_TOKENS: usize = 8;
/// What a turn says, repeated to its length.
const TURN_TEXT: &str = "The next part of the story tells how the travellers crossed the river, \
    what they found on the far bank and why they decided to stay there for the winter.";

/// The context a chat of `TURNS + 1` turns of `turn` new tokens and `n_predict` answers needs.
fn chat_positions(turn: usize, n_predict: u32) -> u32 {
    ((TURNS + 1) * (turn + n_predict as usize + 8) + 64) as u32
}

/// The longest turn (at most [`TURN_TOKENS`]) whose chat fits `positions`.
fn turn_length(positions: u32, n_predict: u32) -> usize {
    ((positions as usize).saturating_sub(64) / (TURNS + 1)).saturating_sub(n_predict as usize + 8).min(TURN_TOKENS)
}

/// A turn's `len` new tokens: [`TURN_TEXT`] repeated, cut to `len` (turn `k` starts with its
/// number, so no two turns are alike).
fn turn_tokens(model: &ggml_sys::Model, k: usize, len: usize) -> Result<Vec<Token>, LaunchError> {
    let mut tokens = tokenize(model, &format!(" Turn {k}."), false)?;
    while tokens.len() < len {
        tokens.extend(tokenize(model, &format!(" {TURN_TEXT}"), false)?);
    }
    tokens.truncate(len);
    Ok(tokens)
}

fn tokenize(model: &ggml_sys::Model, text: &str, bos: bool) -> Result<Vec<Token>, LaunchError> {
    Ok(model.tokenize(text, bos).map_err(GenerateError::from)?)
}

/// The chat: five turns, each from an empty slot (`kept` none) or in one slot that keeps what it
/// can (exact or any prefix); when kept, then the sixth turn warm, and after a restart (the model
/// dropped from memory and the page cache, opened again, the slot saved after turn five read
/// back).
pub fn chat(launch: &Launch, n_predict: u32, kept: Option<Reuse>) -> Result<Vec<BenchRow>, LaunchError> {
    let positions = Positions::ModelCapped(chat_positions(TURN_TOKENS, n_predict));
    let launch = Launch { positions, slots: 1, ..launch.clone() };
    let loaded = launch.load(&mut |_| {})?;
    let len = turn_length(loaded.shape.positions, n_predict);
    if len < MIN_TURN_TOKENS {
        log::warn!(
            "bench: no chat rows: six turns of {MIN_TURN_TOKENS} tokens and {n_predict}-token answers need {} positions, the model's context is {}",
            chat_positions(MIN_TURN_TOKENS, n_predict),
            loaded.shape.positions
        );
        return Ok(Vec::new());
    }
    let (mut session, _) = loaded.open()?;
    session.set_reuse(kept.unwrap_or_default());
    let mut prompt = tokenize(&loaded.model, "", true)?;
    let mut rows = Vec::new();
    let at = SlotUse { slot: 0, reuse: kept.is_some() };
    let mode = match kept {
        Some(Reuse::Any) => ", any prefix (LOSSY)",
        _ => "",
    };
    for turn in 1..=TURNS {
        prompt.extend(turn_tokens(&loaded.model, turn, len)?);
        let (g, decodes) = answer(&mut session, at, &prompt, n_predict)?;
        let how = if kept.is_some() { format!("{} reused{mode}", g.reused) } else { "from an empty slot".into() };
        rows.push(BenchRow::of_generation(
            format!("chat turn {turn} of {TURNS}, {} tokens, {how}", prompt.len()),
            &g,
            &decodes,
        ));
        prompt.extend(&g.tokens);
    }
    let Some(reuse) = kept else { return Ok(rows) };
    let (held, state) = session.session().save_slot(0)?;
    prompt.extend(turn_tokens(&loaded.model, TURNS + 1, len)?);
    let (g, decodes) = answer(&mut session, at, &prompt, n_predict)?;
    rows.push(BenchRow::of_generation(
        format!("chat turn {}, warm, {} reused{mode}", TURNS + 1, g.reused),
        &g,
        &decodes,
    ));
    drop(session);
    let files = loaded.index.shards.clone();
    drop(loaded);
    drop_cached(&files);
    let loaded = launch.load(&mut |_| {})?;
    let (mut session, _) = loaded.open()?;
    session.set_reuse(reuse);
    session.restore_slot(0, &held, &state)?;
    let (g, decodes) = answer(&mut session, at, &prompt, n_predict)?;
    let label = format!("chat turn {} after a restart, saved slot read back, {} reused{mode}", TURNS + 1, g.reused);
    rows.push(BenchRow::of_generation(label, &g, &decodes));
    Ok(rows)
}

/// One greedy answer of `n_predict` tokens to `prompt` in the slot `at` names, with its decodes.
fn answer(
    session: &mut StreamedSession<'_>,
    at: SlotUse,
    prompt: &[Token],
    n_predict: u32,
) -> Result<(Generation, Vec<TokenRow>), LaunchError> {
    let mut sampler = Sampler::greedy(session.model())?;
    let on_token = |_: &Chosen<'_>| ControlFlow::Continue(());
    Ok(session.generate_with(at, prompt, n_predict, &mut sampler, on_token, |_| {})?)
}

/// A greedy client that keeps nothing but its sampler.
struct Greedy(Sampler);

impl Client for Greedy {
    fn sampler(&mut self) -> &mut Sampler {
        &mut self.0
    }

    fn on_token(&mut self, _: &Chosen<'_>) -> ControlFlow<()> {
        ControlFlow::Continue(())
    }
}

/// `clients` generating `n_predict` tokens each at once, each after the launch's prompt with a
/// line of its own in front: one row with their aggregate decode speed (generated tokens over the
/// time of the decodes that carried no prompt) and the MiB read per generated token.
pub fn clients(launch: &Launch, n_predict: u32, clients: u32) -> Result<BenchRow, LaunchError> {
    let loaded = Launch { slots: clients, ..launch.clone() }.load(&mut |_| {})?;
    let (mut session, _) = loaded.open()?;
    let mut greedy = Vec::new();
    let mut runs = Vec::new();
    for c in 0..clients {
        let mut prompt = tokenize(&loaded.model, &format!("Client {c} asks:"), true)?;
        let keep = loaded.prompt.len().saturating_sub(prompt.len());
        prompt.extend(loaded.prompt.iter().skip(1).take(keep));
        let mut sampler = Sampler::greedy(&loaded.model)?;
        runs.push(session.begin(SlotUse { slot: c, reuse: false }, &prompt, n_predict, &mut sampler)?);
        greedy.push(Greedy(sampler));
    }
    let mut decodes = Vec::new();
    while runs.iter().any(|r| !r.is_over()) {
        let mut stepping: Vec<(&mut Run, &mut dyn Client)> =
            runs.iter_mut().zip(greedy.iter_mut()).map(|(r, g)| (r, g as &mut dyn Client)).collect();
        session.step(&mut stepping, |row| decodes.push(row.clone()))?;
    }
    // Until every client has its first token: the decodes up to the last that carried a prompt.
    let prompts_done = decodes.iter().rposition(|r| r.prefill).map_or(0, |i| i + 1);
    let ttft: Duration = decodes[..prompts_done].iter().map(|r| r.wall).sum();
    let mut tokens = Vec::new();
    let mut decoded = 0u64;
    for run in runs {
        let g = session.end(run)?;
        decoded += u64::from(g.decoded);
        tokens.extend(g.tokens);
    }
    // The decodes after the prompts, every client's generated tokens counted.
    let s = Summary { tokens: decoded as usize, ..Summary::of(&decodes) };
    let rate = s.tokens_per_s();
    let (hits, misses) = decodes.iter().filter(|r| !r.prefill).fold((0, 0), |(h, m), r| (h + r.hits, m + r.misses));
    Ok(BenchRow {
        label: format!(
            "{clients} client{} at once, {:.2} tok/s each",
            if clients == 1 { "" } else { "s" },
            rate / f64::from(clients)
        ),
        cache_bytes: Some(loaded.config.cache_bytes),
        tokens_per_s: rate,
        mib_per_token: s.mib_per_token(),
        hit_rate: (hits + misses > 0).then(|| hits as f64 / (hits + misses) as f64),
        major_faults: s.major_faults,
        peak_rss: s.peak_rss,
        read_mib_s: (!s.wall.is_zero()).then(|| mib(s.bytes_read) / s.wall.as_secs_f64()),
        stall_ms: None,
        cgroup_peak: None,
        limit_hits: None,
        open_s: 0.0,
        open_read: 0,
        ttft_s: ttft.as_secs_f64(),
        prefill_read: decodes.iter().filter(|r| r.prefill).map(|r| r.bytes_read).sum(),
        draft_accept: None,
        lossy_quality: None,
        tokens,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_turns_shrink_to_the_models_context_and_fit_it() {
        // A long context: the full turn, and the chat needs what chat_positions says.
        assert_eq!(turn_length(32768, 64), TURN_TOKENS);
        assert_eq!(turn_length(chat_positions(TURN_TOKENS, 64), 64), TURN_TOKENS);
        // The trained model's 256 positions: (256 - 64) / 6 = 32 per turn, less a 16-token answer
        // and 8 for the template: 8 tokens; with 64-token answers nothing fits.
        assert_eq!(turn_length(256, 16), 8);
        assert!(chat_positions(8, 16) <= 256);
        assert_eq!(turn_length(256, 64), 0);
    }
}
