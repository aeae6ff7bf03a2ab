//! Each reader on a small hand-made file of its format gives the routes worked out by hand.

use super::*;
use crate::stream::RouteRecord;

fn decode(decode: u64, layer: u32, experts: &[u32]) -> RouteRecord {
    RouteRecord { decode, layer, tokens: 1, staged: true, experts: experts.to_vec() }
}

fn prompt(decode: u64, layer: u32, tokens: u32, experts: &[u32]) -> RouteRecord {
    RouteRecord { decode, layer, tokens, staged: true, experts: experts.to_vec() }
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// Two layers of four experts, top-2: a 2-token prompt (the first token without its last
/// layer, as llama.cpp computes it) and two decodes, rows out of order and slots unsorted.
const ROUTE_CSV: &str = "# route_trace v1
# model=/data/m/Tiny-MoE.gguf arch=qwen3moe n_layer=2 n_expert=4 n_expert_used=2
# layer=0 expert_bytes=100 dense_bytes=7
# layer=1 expert_bytes=50 dense_bytes=7
turn,phase,step,layer,slot,expert,weight,residency,expert_bytes
0,0,0,0,0,1,0.6,0,100
0,0,0,0,1,2,0.4,0,100
0,0,1,0,0,3,0.6,0,100
0,0,1,0,1,1,0.4,0,100
0,0,1,1,0,0,0.5,0,50
0,0,1,1,1,2,0.5,0,50
0,1,2,0,1,0,0.3,1,0
0,1,2,0,0,3,0.7,0,100
0,1,2,1,0,1,0.6,0,50
0,1,2,1,1,2,0.4,0,50
0,1,3,1,0,2,0.9,0,50
0,1,3,1,1,3,0.1,0,50
0,1,3,0,0,3,0.5,0,100
0,1,3,0,1,2,0.5,0,100
";

#[test]
fn a_route_csv_gives_its_decodes_in_slot_order_and_its_prompt_as_a_batch() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "tiny.route.csv", ROUTE_CSV);
    assert_eq!(detect(&path).unwrap(), Format::RouteCsv);
    let t = read(&path, None, ReadOptions::default()).unwrap();
    assert_eq!((t.model.as_str(), t.n_layer, t.n_expert), ("Tiny-MoE.gguf", 2, 4));
    assert_eq!(t.expert_bytes, vec![100, 100, 100, 100, 50, 50, 50, 50]);
    let decodes = vec![decode(0, 0, &[3, 0]), decode(0, 1, &[1, 2]), decode(1, 0, &[3, 2]), decode(1, 1, &[2, 3])];
    assert_eq!(t.steps, decodes);
    let t = read(&path, None, ReadOptions { prompt: true }).unwrap();
    let mut with_prompt = vec![prompt(0, 0, 2, &[1, 2, 3]), prompt(0, 1, 2, &[0, 2])];
    with_prompt.extend(decodes.into_iter().map(|s| RouteRecord { decode: s.decode + 1, ..s }));
    assert_eq!(t.steps, with_prompt);
}

#[test]
fn speculative_moe_lines_give_each_problem_the_tokens_every_layer_has() {
    let dir = tempfile::tempdir().unwrap();
    // Problem 0: layer 1 lost its last row (caveat M2), so it keeps two tokens; problem 3 one.
    let row = |p, l, t, e: [u32; 2]| {
        format!(
            r#"{{"dataset": "x", "problem_id": {p}, "layer": {l}, "experts": {e:?}, "gating_probs": [0.6, 0.4], "token_idx": {t}}}"#
        )
    };
    let text = [
        row(0, 0, 0, [6, 5]),
        row(0, 1, 0, [1, 2]),
        row(0, 0, 1, [5, 3]),
        row(0, 1, 1, [2, 7]),
        row(0, 0, 2, [7, 5]),
        row(3, 0, 0, [0, 1]),
        row(3, 1, 0, [1, 0]),
    ]
    .join("\n");
    let path = write(dir.path(), "x_routing.jsonl", &text);
    assert_eq!(detect(&path).unwrap(), Format::SpeculativeMoe);
    let t = read(&path, None, ReadOptions::default()).unwrap();
    assert_eq!((t.n_layer, t.n_expert), (2, 8));
    assert_eq!(
        t.steps,
        vec![
            decode(0, 0, &[6, 5]),
            decode(0, 1, &[1, 2]),
            decode(1, 0, &[5, 3]),
            decode(1, 1, &[2, 7]),
            decode(2, 0, &[0, 1]),
            decode(2, 1, &[1, 0]),
        ]
    );
}

#[test]
fn a_raw_speculative_moe_file_splits_prompt_from_decode_at_position_zero() {
    let dir = tempfile::tempdir().unwrap();
    let row = |l, pos, e: [u32; 2]| {
        format!(
            r#"{{"dataset": "x", "problem_id": 0, "layer": {l}, "token_pos": {pos}, "experts": {e:?}, "gating_probs": [0.5, 0.5]}}"#
        )
    };
    // Prompt of two positions, then two decodes (each at position 0), per layer.
    let mut lines = Vec::new();
    for l in 0..2 {
        lines.extend([row(l, 0, [1, 2]), row(l, 1, [2, 3]), row(l, 0, [4, 5]), row(l, 0, [5, 6 + l])]);
    }
    let path = write(dir.path(), "routing_raw.jsonl", &lines.join("\n"));
    let t = read(&path, None, ReadOptions::default()).unwrap();
    let decodes = vec![decode(0, 0, &[4, 5]), decode(0, 1, &[4, 5]), decode(1, 0, &[5, 6]), decode(1, 1, &[5, 7])];
    assert_eq!(t.steps, decodes);
    let t = read(&path, None, ReadOptions { prompt: true }).unwrap();
    let mut with_prompt = vec![prompt(0, 0, 2, &[1, 2, 3]), prompt(0, 1, 2, &[1, 2, 3])];
    with_prompt.extend(decodes.into_iter().map(|s| RouteRecord { decode: s.decode + 1, ..s }));
    assert_eq!(t.steps, with_prompt);
}

#[test]
fn a_moe_beyond_folder_gives_its_prompts_in_number_order() {
    let dir = tempfile::tempdir().unwrap();
    let head = "Layer ID,Batch Number,Token,Activated Expert IDs\n";
    write(dir.path(), "prompt_10_data.csv", &format!("{head}1,0,a,\"[9, 8]\"\n2,0,a,\"[7, 6]\"\n"));
    write(
        dir.path(),
        "prompt_2_data.csv",
        &format!("{head}1,0,<s>,\"[0, 1]\"\n1,0,Ġb,\"[1, 2]\"\n2,0,<s>,\"[3, 4]\"\n2,0,\"Ġ,\",\"[4, 5]\"\n"),
    );
    write(dir.path(), "notes.txt", "not a prompt");
    assert_eq!(detect(dir.path()).unwrap(), Format::MoeBeyond);
    let t = read(dir.path(), None, ReadOptions::default()).unwrap();
    assert_eq!((t.n_layer, t.n_expert), (2, 10));
    assert_eq!(t.expert_bytes, vec![UNSIZED_EXPERT_BYTES; 20]);
    assert_eq!(
        t.steps,
        vec![
            decode(0, 0, &[0, 1]),
            decode(0, 1, &[3, 4]),
            decode(1, 0, &[1, 2]),
            decode(1, 1, &[4, 5]),
            decode(2, 0, &[9, 8]),
            decode(2, 1, &[7, 6]),
        ]
    );
}

#[test]
fn damaged_files_are_refused_with_where_and_what() {
    let dir = tempfile::tempdir().unwrap();
    for (name, text, says) in [
        ("a.route.csv", ROUTE_CSV.replace("n_expert=4", "n_expert=3"), "expert id 3 is out of range for the 3 experts"),
        ("b.route.csv", ROUTE_CSV.replace("0,1,3,0,1,2,", "0,1,3,5,1,2,"), "names layer 5 of the 2 layers"),
        ("c.route.csv", ROUTE_CSV.replace("0,1,2,1,0,1,", "0,1,2,1,x,1,"), "line 14: column `slot`"),
        ("d.route.csv", "# route_trace v1\nturn,phase\n".into(), "no `# model=... n_layer=N n_expert=N` line"),
        (
            "e.jsonl",
            "{\"problem_id\": 0, \"layer\": 0, \"experts\": [1]}".into(),
            "line 1: neither token_idx nor token_pos",
        ),
        (
            "f.jsonl",
            "{\"problem_id\": 0, \"layer\": 0, \"experts\": [1], \"token_idx\": 0}\n{\"problem_id\": 0,".into(),
            "line 2:",
        ),
    ] {
        let path = write(dir.path(), name, &text);
        let e = read(&path, None, ReadOptions::default()).unwrap_err().to_string();
        assert!(e.contains(says) && e.contains(name), "{name}: {e}");
    }
    let path = write(dir.path(), "g.txt", "hello");
    assert!(read(&path, None, ReadOptions::default()).unwrap_err().to_string().contains("--format"));
    let empty = tempfile::tempdir().unwrap();
    assert!(read(empty.path(), None, ReadOptions::default())
        .unwrap_err()
        .to_string()
        .contains("no prompt_<n>_data.csv"));
}

#[test]
fn a_sluice_trace_gives_its_single_token_decodes_and_refuses_a_batch_step() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.sluice-trace");
    let trace = |steps| RouteTrace {
        model: "m.gguf".into(),
        n_layer: 2,
        n_expert: 4,
        expert_bytes: vec![1; 8],
        staging: 0,
        budget: 2,
        policy: CachePolicy::Lru,
        steps,
    };
    trace(vec![decode(0, 0, &[3, 1]), decode(0, 1, &[2, 0]), decode(1, 1, &[1, 2])]).save(&path).unwrap();
    let t = read_tokens(&path, None).unwrap();
    let want = vec![vec![Some(vec![3, 1]), Some(vec![2, 0])], vec![None, Some(vec![1, 2])]];
    assert_eq!((t.n_layer, t.n_expert, t.tokens), (2, 4, want));
    trace(vec![prompt(0, 0, 5, &[0, 1, 2]), decode(1, 0, &[3, 1])]).save(&path).unwrap();
    let e = read_tokens(&path, None).unwrap_err().to_string();
    assert!(e.contains("t.sluice-trace") && e.contains("a batch of 5 tokens") && e.contains("--record-routes"), "{e}");
}

#[test]
fn a_header_of_no_model_s_shape_is_refused_before_any_row_is_sized_by_it() {
    let dir = tempfile::tempdir().unwrap();
    let text = ROUTE_CSV.replace("n_layer=2 n_expert=4", "n_layer=4000000000 n_expert=4");
    let path = write(dir.path(), "huge.route.csv", &text);
    for e in [read(&path, None, ReadOptions { prompt: true }).unwrap_err(), read_tokens(&path, None).unwrap_err()] {
        let e = e.to_string();
        assert!(
            e.contains("huge.route.csv") && e.contains("4000000000 layers of 4 experts is not a model's shape"),
            "{e}"
        );
    }
}
