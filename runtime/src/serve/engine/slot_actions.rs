//! llama-server's slot actions (`POST /slots/{id}?action=save|restore|erase`) on the slots the
//! engine keeps: asked by the HTTP front, run by the engine between its steps. A save writes the
//! slot into the saved slots of the state directory (named by what it holds: the answer gives the
//! name), a restore reads one of them back, an erase empties the slot.

use std::time::Instant;

use serde_json::{json, Value};

use super::Engine;
use crate::serve::error::ApiError;
use crate::serve::messages::SlotAction;

impl Engine<'_, '_> {
    /// Runs the slot actions asked since the last step.
    pub(super) fn run_slot_actions(&mut self) {
        for r in self.shared.slot_actions.take() {
            let answer = self.slot_action(r.slot, r.action);
            let _ = r.reply.send(answer);
        }
    }

    fn slot_action(&mut self, slot: u32, action: SlotAction) -> Result<Value, ApiError> {
        let count = self.slots.count();
        if slot as usize >= count {
            return Err(ApiError::invalid(
                format!("slot {slot}: this server has {count} slot(s), 0 to {}", count - 1),
                Some("id_slot"),
            ));
        }
        if self.slots.busy(slot) {
            return Err(ApiError::new(
                409,
                "invalid_request_error",
                format!("slot {slot} runs a request; retry when it ends"),
            ));
        }
        let t0 = Instant::now();
        let ms = || t0.elapsed().as_secs_f64() * 1000.0;
        let no_store = || {
            ApiError::invalid(
                "slots are saved in the state directory: start serve with --state-dir (the service has one) and --slot-save-mib above 0",
                None,
            )
        };
        let answer = match action {
            SlotAction::Erase => {
                let n = self.slots.erase(&mut self.session, slot).map_err(|e| ApiError::new(500, "server_error", e))?;
                json!({"id_slot": slot, "n_erased": n})
            }
            SlotAction::Save => {
                let store = self.store.as_mut().ok_or_else(no_store)?;
                let (name, n, bytes) =
                    self.slots.save_now(&self.session, store, slot).map_err(|e| ApiError::invalid(e, None))?;
                json!({"id_slot": slot, "filename": name, "n_saved": n, "n_written": bytes, "timings": {"save_ms": ms()}})
            }
            SlotAction::Restore(name) => {
                let store = self.store.as_ref().ok_or_else(no_store)?;
                let n = self
                    .slots
                    .restore_named(&mut self.session, store, &name, slot)
                    .map_err(|e| ApiError::new(404, "not_found_error", e).with_param("filename"))?;
                json!({"id_slot": slot, "filename": name, "n_restored": n, "timings": {"restore_ms": ms()}})
            }
        };
        self.publish_slots();
        Ok(answer)
    }
}
