//! The server's slots: conversations whose memory (llama.cpp's KV cache, one sequence each) is
//! kept between requests. A request goes to the slot that already holds the longest prefix of
//! its prompt (ties: the least recently used), or to a saved slot read back from the state
//! directory when that holds more of it; the slots changed since they were saved are written
//! back when the server is idle and when it stops.

use std::path::Path;

use ggml_sys::Token;

use super::heat::ModelIdentity;
use super::saved_slots::{SlotKey, SlotStore};
use crate::generate::{ContextShape, Reuse, SlotUse};
use crate::serve::job::Owner;
use crate::serve::metrics::SlotView;
use crate::stream::{ExpertIndex, StreamedSession};

/// The slots' bookkeeping beside the session that holds their memory.
#[derive(Debug)]
pub struct Slots {
    /// When each slot last served a request (the request count then).
    last_used: Vec<u64>,
    requests: u64,
    /// Whether each slot's memory changed since it was saved (or restored).
    unsaved: Vec<bool>,
    /// Each slot's last request: prompt tokens reused, computed.
    last: Vec<(usize, usize)>,
    /// Whether each slot runs a request.
    busy: Vec<bool>,
    /// The client whose prompts each slot's memory holds ([`Owner`]): reused for it alone.
    owner: Vec<Owner>,
}

/// The slot for a prompt that slot `s` would keep `reusable[s]` tokens of, among those not
/// `busy`: the one that keeps the most; among equals, the least recently used (`last_used`).
pub fn choose(reusable: &[usize], last_used: &[u64], busy: &[bool]) -> u32 {
    let free = (0..reusable.len()).filter(|&s| !busy[s]);
    let best = free.max_by_key(|&s| (reusable[s], std::cmp::Reverse(last_used[s])));
    best.unwrap_or(0) as u32
}

impl Slots {
    /// Bookkeeping for `n` empty slots.
    pub fn new(n: u32) -> Slots {
        let n = n.max(1) as usize;
        Slots {
            last_used: vec![0; n],
            requests: 0,
            unsaved: vec![false; n],
            last: vec![(0, 0); n],
            busy: vec![false; n],
            owner: vec![Owner::default(); n],
        }
    }

    /// Picks a free slot for `owner`'s `prompt` (see [`choose`]; only `owner`'s own slots keep
    /// any of it), its memory kept with `cache_prompt`; then a saved slot of `owner`'s that holds
    /// more of the prompt than any free slot is read back into the least recently used free slot
    /// first (that slot saved before, if it changed). A saved slot that cannot be read is dropped
    /// with a warning and the prompt is computed. The slot is `owner`'s from then on.
    pub fn pick(
        &mut self,
        session: &mut StreamedSession<'_>,
        store: Option<&mut SlotStore>,
        prompt: &[Token],
        cache_prompt: bool,
        owner: &Owner,
    ) -> SlotUse {
        let inner = session.session();
        // `cache_prompt: false` still goes to its conversation's slot (computed afresh there), so
        // that it does not take another conversation's.
        let reusable: Vec<usize> = (0..inner.slots())
            .map(|s| if self.owner[s as usize] == *owner { inner.reusable(s, prompt) } else { 0 })
            .collect();
        let mut slot = choose(&reusable, &self.last_used, &self.busy);
        let (kept, unit) = (reusable[slot as usize], inner.reuse_unit());
        // Another client's memory is computed over, never reused.
        let reuse = cache_prompt && self.owner[slot as usize] == *owner;
        let Some(store) = store.filter(|_| cache_prompt) else {
            self.owner[slot as usize] = owner.clone();
            return SlotUse { slot, reuse };
        };
        let mut read = false;
        if store.best(prompt, kept, unit, owner).is_some() {
            slot = self.least_recently_used();
            self.save_one(session, store, slot);
            // Saving may have removed saved slots (the one it extends, the oldest): find it again.
            if let Some(entry) = store.best(prompt, kept, unit, owner) {
                if read_back(session, store, entry, slot) {
                    self.unsaved[slot as usize] = false;
                    read = true;
                } else {
                    store.forget(entry);
                }
            }
        }
        let reuse = read || self.owner[slot as usize] == *owner;
        self.owner[slot as usize] = owner.clone();
        SlotUse { slot, reuse }
    }

    /// Reads the newest saved slots back, the newest into slot 0 (a saved slot that cannot be
    /// read is dropped with a warning).
    pub fn restore(&mut self, session: &mut StreamedSession<'_>, store: &mut SlotStore) {
        let mut unusable = Vec::new();
        let mut slot = 0;
        for entry in store.newest() {
            if slot as usize == self.unsaved.len() {
                break;
            }
            if read_back(session, store, entry, slot) {
                self.owner[slot as usize] = store.owner(entry).clone();
                slot += 1;
            } else {
                unusable.push(entry);
            }
        }
        unusable.sort_unstable();
        for entry in unusable.into_iter().rev() {
            store.forget(entry);
        }
    }

    /// The free slot that served a request longest ago.
    fn least_recently_used(&self) -> u32 {
        let free = (0..self.last_used.len()).filter(|&s| !self.busy[s]);
        free.min_by_key(|&s| self.last_used[s]).unwrap_or(0) as u32
    }

    /// How many slots there are.
    pub fn count(&self) -> usize {
        self.busy.len()
    }

    /// Marks `slot` busy with a request.
    pub fn start(&mut self, slot: u32) {
        self.requests += 1;
        self.last_used[slot as usize] = self.requests;
        self.busy[slot as usize] = true;
    }

    /// Marks `slot`'s request ended after reusing `reused` prompt tokens and computing
    /// `computed`; its memory has changed.
    pub fn finish(&mut self, slot: u32, reused: usize, computed: usize) {
        self.busy[slot as usize] = false;
        self.last[slot as usize] = (reused, computed);
        self.unsaved[slot as usize] = true;
    }

    /// Whether some slot changed since it was saved.
    pub fn any_unsaved(&self) -> bool {
        self.unsaved.iter().any(|&u| u)
    }

    /// Writes every slot that changed since it was saved to `store` (not those running a
    /// request: they are saved once it ends).
    pub fn save_all(&mut self, session: &StreamedSession<'_>, store: &mut SlotStore) {
        for slot in 0..self.unsaved.len() as u32 {
            if !self.busy[slot as usize] {
                self.save_one(session, store, slot);
            }
        }
    }

    /// Writes `slot` to `store` if it changed since it was saved (a failure is a warning: the
    /// slot stays in memory).
    fn save_one(&mut self, session: &StreamedSession<'_>, store: &mut SlotStore, slot: u32) {
        let inner = session.session();
        let whole = inner.all_keepable(slot);
        if !std::mem::take(&mut self.unsaved[slot as usize]) || inner.held(slot).is_empty() || !whole {
            return;
        }
        match session.session().save_slot(slot) {
            Ok((tokens, state)) => match store.save(&tokens, &state, &self.owner[slot as usize]) {
                Ok(_) => log::info!(
                    "slot {slot} saved: {} tokens, {:.1} MiB of state",
                    tokens.len(),
                    crate::units::mib(state.len() as u64)
                ),
                Err(e) => log::warn!("slot {slot} not saved: {e}"),
            },
            Err(e) => log::warn!("slot {slot} not saved: {e}"),
        }
    }

    /// Whether `slot` runs a request.
    pub fn busy(&self, slot: u32) -> bool {
        self.busy.get(slot as usize).copied().unwrap_or(false)
    }

    /// Saves `slot` to `store` now (a client asked): the saved file's name, the tokens and the
    /// bytes of state.
    pub fn save_now(
        &mut self,
        session: &StreamedSession<'_>,
        store: &mut SlotStore,
        slot: u32,
    ) -> Result<(String, usize, usize), String> {
        let inner = session.session();
        if inner.held(slot).is_empty() {
            return Err(format!("slot {slot} holds nothing to save"));
        }
        if !inner.all_keepable(slot) {
            return Err(format!(
                "slot {slot} holds tokens outside whole prompt batches, which a later prompt could not keep (--reuse any keeps them)"
            ));
        }
        let (tokens, state) = inner.save_slot(slot).map_err(|e| e.to_string())?;
        let name = store.save(&tokens, &state, &self.owner[slot as usize]).map_err(|e| e.to_string())?;
        self.unsaved[slot as usize] = false;
        Ok((name, tokens.len(), state.len()))
    }

    /// Reads saved file `name` back into `slot`: the tokens it holds.
    pub fn restore_named(
        &mut self,
        session: &mut StreamedSession<'_>,
        store: &SlotStore,
        name: &str,
        slot: u32,
    ) -> Result<usize, String> {
        let entry = store.find(name).ok_or_else(|| format!("no saved slot {name:?} for this model is kept"))?;
        if !read_back(session, store, entry, slot) {
            return Err(format!("{} cannot be read back (the log says why)", store.describe(entry)));
        }
        self.owner[slot as usize] = store.owner(entry).clone();
        self.unsaved[slot as usize] = false;
        Ok(session.session().held(slot).len())
    }

    /// Empties `slot`: the tokens it held.
    pub fn erase(&mut self, session: &mut StreamedSession<'_>, slot: u32) -> Result<usize, String> {
        let held = session.session().held(slot).len();
        session.forget(slot).map_err(|e| e.to_string())?;
        self.unsaved[slot as usize] = false;
        Ok(held)
    }

    /// The slots as the status page and `/metrics` show them.
    pub fn views(&self, session: &StreamedSession<'_>) -> Vec<SlotView> {
        (0..self.last.len())
            .map(|s| SlotView {
                busy: self.busy[s],
                tokens: session.session().held(s as u32).len(),
                reused: self.last[s].0,
                computed: self.last[s].1,
            })
            .collect()
    }
}

/// The saved slots of this model and context shape in the state directory, if any are to be kept
/// (a directory that cannot be used is a warning: slots are then not saved).
pub fn open_store(
    state_dir: Option<&Path>,
    save_bytes: u64,
    identity: &ModelIdentity,
    index: &ExpertIndex,
    shape: ContextShape,
    reuse: Reuse,
) -> Option<SlotStore> {
    let dir = state_dir.filter(|_| save_bytes > 0)?;
    let key = match SlotKey::new(identity.clone(), &index.shards, shape, reuse) {
        Ok(k) => k,
        Err(e) => {
            log::warn!("cannot identify the model's files ({e}): slots are not saved");
            return None;
        }
    };
    match SlotStore::open(dir, key, save_bytes) {
        Ok(s) => Some(s),
        Err(e) => {
            log::warn!("{e}: slots are not saved");
            None
        }
    }
}

/// Reads saved slot `entry` into `slot`; false (with a warning, the slot empty) when it cannot be.
fn read_back(session: &mut StreamedSession<'_>, store: &SlotStore, entry: usize, slot: u32) -> bool {
    let read = store.load(entry).map_err(|e| e.to_string()).and_then(|(tokens, state)| {
        session.restore_slot(slot, &tokens, &state).map_err(|e| e.to_string()).map(|()| tokens.len())
    });
    match read {
        Ok(n) => {
            log::info!("slot {slot}: {n} tokens read back from {}", store.describe(entry));
            true
        }
        Err(e) => {
            log::warn!("{}: not used ({e}); its prompt is computed", store.describe(entry));
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slot_that_keeps_most_wins_and_ties_go_to_the_least_recently_used() {
        let free = [false; 3];
        assert_eq!(choose(&[0, 5, 3], &[1, 2, 3], &free), 1);
        assert_eq!(choose(&[0, 0, 0], &[3, 1, 2], &free), 1, "nothing kept: the least recently used");
        assert_eq!(choose(&[4, 4, 1], &[9, 2, 1], &free), 1, "a tie on what is kept");
        assert_eq!(choose(&[0], &[0], &[false]), 0);
        assert_eq!(choose(&[0, 5, 3], &[1, 2, 3], &[false, true, false]), 2, "a busy slot is not chosen");
        assert_eq!(choose(&[0, 5, 3], &[1, 2, 3], &[false, true, true]), 0);
    }
}
