use super::*;

#[test]
fn lossy_settings_and_substitutions_are_exposed() {
    let m = Metrics::default();
    let text = m.render("ready", 0);
    assert!(text.contains("sluice_lossy_experts_used 0\n") && text.contains("sluice_lossy_substitute_ranks 0\n"));
    m.set_lossy(&crate::lossy::Lossy { experts_used: Some(2), substitute: Some(4) });
    let text = m.render("ready", 0);
    assert!(text.contains("sluice_lossy_experts_used 2\n"), "{text}");
    assert!(text.contains("sluice_lossy_substitute_ranks 4\n"), "{text}");
    assert!(text.contains("# TYPE sluice_expert_substitutions_total counter"), "{text}");
}

#[test]
fn every_state_has_its_sample_and_the_current_one_is_1() {
    let text = Metrics::default().render("degraded", 0);
    for s in crate::serve::state::State::ALL {
        let v = if s == crate::serve::state::State::Degraded { 1 } else { 0 };
        assert!(text.contains(&format!("sluice_state{{state=\"{}\"}} {v}\n", s.as_str())), "{text}");
    }
}

#[test]
fn status_has_this_minutes_speed_the_hit_rate_and_the_heat_map() {
    let m = Metrics::default();
    let s = m.status("loading", None, "m", 0);
    assert_eq!(s["decode_tokens_per_second"]["per_minute"].as_array().unwrap().len(), STATUS_MINUTES as usize);
    assert!(s["expert_cache"]["hit_rate"].is_null());
    m.generation(GenerationCounts {
        prompt_tokens: 3,
        reused_tokens: 2,
        completion_tokens: 9,
        decode: Duration::from_secs(2),
        decoded: 8,
    });
    m.decode_row(&TokenRow { hits: 3, misses: 1, ..TokenRow::default() });
    m.set_heat(2, 3, &[1, 2, 3, 4, 5, 6]);
    let s = m.status("ready", None, "m", 1);
    let minutes = s["decode_tokens_per_second"]["per_minute"].as_array().unwrap();
    // The generation counts in this minute, or in the next if the minute turned meanwhile.
    let last_two: f64 = minutes[minutes.len() - 2..].iter().map(|v| v.as_f64().unwrap()).sum();
    assert_eq!(last_two, 4.0, "{s}");
    assert_eq!(s["decode_tokens_per_second"]["last"], 4.0);
    assert_eq!(s["expert_cache"]["hit_rate"], 0.75);
    assert_eq!(s["heat"]["counts"].as_array().unwrap().len(), 6);
    assert_eq!((s["heat"]["layers"].as_u64(), s["heat"]["experts"].as_u64()), (Some(2), Some(3)));
}
