//! The responses `/v1/responses` keeps for a later `previous_response_id`, `GET`, `DELETE` and
//! `input_items`: each one's conversation as chat messages, the response object and its input
//! items, in memory, the oldest dropped first once either bound is reached. A restart forgets
//! them (the client then sends the whole conversation).

use std::collections::{HashMap, VecDeque};

use serde_json::Value;

/// Most responses kept.
pub const MAX_RESPONSES: usize = 256;
/// Most bytes of conversation text kept (as JSON); a conversation alone over it is not kept.
pub const MAX_BYTES: usize = 16 << 20;

/// One kept response.
#[derive(Debug, Clone, Default)]
pub struct Kept {
    /// Its conversation as chat messages (the previous response's, its input, its answer).
    pub messages: Vec<Value>,
    /// The response object.
    pub response: Value,
    /// Its request's input items.
    pub input_items: Vec<Value>,
}

/// Kept responses, bounded by count and bytes.
#[derive(Debug, Default)]
pub struct StoredResponses {
    order: VecDeque<String>,
    kept: HashMap<String, (Kept, usize)>,
    bytes: usize,
}

impl StoredResponses {
    /// The conversation of response `id`, if it is kept.
    pub fn get(&self, id: &str) -> Option<Vec<Value>> {
        self.kept.get(id).map(|(k, _)| k.messages.clone())
    }

    /// Response `id`, if it is kept.
    pub fn kept(&self, id: &str) -> Option<&Kept> {
        self.kept.get(id).map(|(k, _)| k)
    }

    /// Forgets response `id`; false when it was not kept.
    pub fn delete(&mut self, id: &str) -> bool {
        let Some((_, n)) = self.kept.remove(id) else { return false };
        self.bytes -= n;
        self.order.retain(|o| o != id);
        true
    }

    /// Keeps response `id`, dropping the oldest to stay within the bounds; false when it alone
    /// is over them.
    pub fn put(&mut self, id: String, kept: Kept) -> bool {
        let size = [
            serde_json::to_string(&kept.messages),
            serde_json::to_string(&kept.response),
            serde_json::to_string(&kept.input_items),
        ]
        .into_iter()
        .try_fold(0usize, |sum, s| s.map(|s| sum + s.len()))
        .unwrap_or(usize::MAX);
        if size > MAX_BYTES {
            return false;
        }
        while self.order.len() >= MAX_RESPONSES || self.bytes + size > MAX_BYTES {
            let Some(old) = self.order.pop_front() else { break };
            if let Some((_, n)) = self.kept.remove(&old) {
                self.bytes -= n;
            }
        }
        self.bytes += size;
        self.order.push_back(id.clone());
        self.kept.insert(id, (kept, size));
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_oldest_go_first_and_the_bounds_hold() {
        let kept = |messages: Vec<Value>| Kept { messages, ..Kept::default() };
        let mut s = StoredResponses::default();
        for i in 0..MAX_RESPONSES + 3 {
            assert!(s.put(format!("r{i}"), kept(vec![json!({"role": "user", "content": i})])));
        }
        assert_eq!(s.order.len(), MAX_RESPONSES);
        assert!(s.get("r0").is_none() && s.get("r2").is_none());
        assert_eq!(s.get("r3").unwrap()[0]["content"], 3);
        let big = kept(vec![json!("x".repeat(MAX_BYTES / 2))]);
        assert!(s.put("big1".into(), big.clone()) && s.put("big2".into(), big.clone()));
        assert!(s.get("big1").is_none(), "two halves and the rest do not fit: the oldest went");
        assert!(s.bytes <= MAX_BYTES);
        assert!(!s.put("huge".into(), kept(vec![json!("x".repeat(MAX_BYTES))])));
        assert!(s.get("huge").is_none() && s.get("big2").is_some());
        let before = s.bytes;
        assert!(s.delete("big2") && !s.delete("big2"));
        assert!(s.get("big2").is_none() && s.bytes < before && !s.order.iter().any(|o| o == "big2"));
    }
}
