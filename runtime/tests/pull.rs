//! `sluice pull` against a Hugging Face-shaped hub and an Ollama-shaped registry on loopback
//! (`pulling/hosts.rs`): what lands in the store is byte for byte what the host holds, its
//! checksum sidecar is what `sluice verify` writes, and every fault (a dropped connection, a
//! damaged byte, a stall, a gated repository, a changed file, a full disk, a killed pull) ends in
//! a whole, checked model or in an error that names the file and stores nothing.

mod common;
mod pulling;
mod serving;

use std::path::{Path, PathBuf};
use std::process::Output;

use pulling::hosts::{read, sha256_hex, Hosts, World};
use sluice::synth::{self, SynthSpec};

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

/// The test's store folders and model files.
struct Scene {
    dir: tempfile::TempDir,
}

impl Scene {
    fn new() -> Scene {
        Scene { dir: tempfile::tempdir().unwrap() }
    }

    fn hub_cache(&self) -> PathBuf {
        self.dir.path().join("hub")
    }

    fn ollama(&self) -> PathBuf {
        self.dir.path().join("ollama")
    }

    /// `sluice ARGS` with the store here and the hosts' addresses.
    fn sluice(&self, hosts: &Hosts, args: &[&str]) -> Output {
        let mut cmd = common::sluice_command();
        cmd.args(args)
            .env("HF_HUB_CACHE", self.hub_cache())
            .env("OLLAMA_MODELS", self.ollama())
            .env("HF_ENDPOINT", &hosts.url)
            .env("SLUICE_OLLAMA_REGISTRY", &hosts.url)
            .env("HOME", self.dir.path())
            .env_remove("HF_TOKEN")
            .env_remove("HF_HOME");
        cmd.output().expect("run sluice")
    }

    fn pull(&self, hosts: &Hosts, name: &str, extra: &[&str]) -> Output {
        let mut args = vec!["pull", name, "--progress", "lines", "--stall-seconds", "2", "--chunk-kib", "256"];
        args.extend_from_slice(extra);
        self.sluice(hosts, &args)
    }

    fn snapshot(&self, repo: &str, file: &str) -> PathBuf {
        self.hub_cache().join(format!("models--{}", repo.replace('/', "--"))).join("snapshots").join(COMMIT).join(file)
    }
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// A small synthetic MoE model (f16), split in `shards` files when more than one; its files.
fn model(dir: &Path, split: bool) -> Vec<PathBuf> {
    let spec = SynthSpec { seed: 7, split_max_tensors: split.then_some(7), ..SynthSpec::default() };
    let name = if split { "m-F16-00001-of-00005.gguf" } else { "m-F16.gguf" };
    synth::synthesize(&spec, &dir.join(name), 2).expect("synthesize").files
}

/// Every file of the store's tree that is not a link or a directory, relative.
fn leftovers(dir: &Path, pattern: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.to_string_lossy().contains(pattern) {
                out.push(p);
            }
        }
    }
    out
}

fn repo_of(files: &[PathBuf]) -> Vec<(String, Vec<u8>)> {
    files.iter().map(|f| (format!("F16/{}", f.file_name().unwrap().to_string_lossy()), read(f))).collect()
}

/// A scene, the model made in it (`split`: in shards) and a hub world holding it as `repo`.
fn hub_repo(repo: &str, split: bool) -> (Scene, Vec<PathBuf>, World) {
    let scene = Scene::new();
    let files = model(scene.dir.path(), split);
    let mut world = World::default();
    world.add_repo(repo, COMMIT, repo_of(&files));
    (scene, files, world)
}

#[test]
fn a_split_model_is_pulled_whole_and_its_sidecar_is_what_verify_writes() {
    let (scene, files, world) = hub_repo("test/split-GGUF", true);
    let hosts = Hosts::start(world);
    let out = scene.pull(&hosts, "hf.co/test/split-GGUF:f16", &["--connections", "3"]);
    assert!(out.status.success(), "{}", text(&out));
    for f in &files {
        let name = format!("F16/{}", f.file_name().unwrap().to_string_lossy());
        let stored = scene.snapshot("test/split-GGUF", &name);
        assert_eq!(read(&stored), read(f), "{name} differs from the host's");
        assert!(
            std::fs::symlink_metadata(&stored).unwrap().file_type().is_symlink(),
            "the hub cache links snapshots to blobs"
        );
    }
    let first = scene.snapshot("test/split-GGUF", &format!("F16/{}", files[0].file_name().unwrap().to_string_lossy()));
    let pulled_sums = read(&sluice::stream::checksums::sidecar_of(&first));
    let verify = common::sluice_command().args(["verify", "--model"]).arg(&files[0]).output().unwrap();
    assert!(verify.status.success(), "{}", text(&verify));
    assert_eq!(
        pulled_sums,
        read(&sluice::stream::checksums::sidecar_of(&files[0])),
        "the pull's sidecar differs from sluice verify's"
    );
    assert!(leftovers(&scene.hub_cache(), ".sluice-partial").is_empty());

    let listed = scene.sluice(&hosts, &["models", "--board", "generic"]);
    let row = text(&listed).lines().find(|l| l.starts_with("test/split-GGUF:F16")).map(str::to_string);
    let row = row.unwrap_or_else(|| panic!("not listed: {}", text(&listed)));
    assert!(row.contains(" F16 ") && row.contains("qwen3moe") && row.contains(" yes "), "{row}");
    let plan = scene.sluice(&hosts, &["plan", "--model", "test/split-GGUF:F16", "--board", "generic"]);
    assert!(plan.status.success(), "a stored name is a model everywhere a path goes: {}", text(&plan));
    let again = scene.pull(&hosts, "test/split-GGUF:F16", &[]);
    assert!(again.status.success(), "{}", text(&again));
    assert!(text(&again).contains("0 B fetched"), "a stored model is not fetched again: {}", text(&again));
    let removed = scene.sluice(&hosts, &["models", "--rm", "test/split-GGUF:F16"]);
    assert!(removed.status.success(), "{}", text(&removed));
    assert!(leftovers(&scene.hub_cache(), "blobs").is_empty(), "removing frees the blobs");
}

#[test]
fn a_dropped_connection_and_a_stall_resume_where_they_broke_off() {
    let (scene, files, mut world) = hub_repo("test/m-GGUF", false);
    let size = read(&files[0]).len() as u64;
    world.drop_after = Some((2, 100_000));
    world.stall_after = Some((3, 50_000));
    let hosts = Hosts::start(world);
    let out = scene.pull(&hosts, "test/m-GGUF", &["--connections", "1", "--no-plan"]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(read(&scene.snapshot("test/m-GGUF", "F16/m-F16.gguf")), read(&files[0]));
    let ranges = hosts.with(|w| w.ranges.clone());
    assert_eq!(ranges[1].0, ranges[0].0 + 100_000, "the second try starts where the dropped one ended: {ranges:?}");
    assert_eq!(ranges[3].0, ranges[2].0 + 50_000, "the try after the stall starts where it stalled: {ranges:?}");
    let fetched: u64 = ranges.iter().map(|(a, b)| b - a + 1).sum::<u64>()
        - (ranges[0].1 - ranges[0].0 + 1 - 100_000)
        - (ranges[1].1 - ranges[1].0 + 1 - 100_000)
        - (ranges[2].1 - ranges[2].0 + 1 - 50_000);
    assert_eq!(fetched, size, "no byte was fetched twice: {ranges:?}");
}

#[test]
fn one_damaged_byte_fails_naming_the_file_and_stores_nothing() {
    let (scene, _, mut world) = hub_repo("test/m-GGUF", false);
    world.corrupt = true;
    let hosts = Hosts::start(world);
    let out = scene.pull(&hosts, "test/m-GGUF:F16", &[]);
    assert!(!out.status.success());
    let t = text(&out);
    assert!(t.contains("F16/m-F16.gguf") && t.contains("sha256") && t.contains("nothing was stored"), "{t}");
    let left = leftovers(&scene.hub_cache(), "");
    assert!(left.is_empty(), "a failed pull leaves nothing in the store: {left:?}");
    let run = scene.sluice(&hosts, &["plan", "--model", "test/m-GGUF:F16"]);
    assert!(text(&run).contains("sluice pull test/m-GGUF:F16"), "{}", text(&run));
}

#[test]
fn gated_and_missing_models_say_what_to_do() {
    let (scene, _, mut world) = hub_repo("test/m-GGUF", false);
    world.token = Some("hf_secret".into());
    let hosts = Hosts::start(world);
    let gated = scene.pull(&hosts, "test/m-GGUF", &[]);
    assert!(!gated.status.success());
    assert!(text(&gated).contains("HF_TOKEN") && text(&gated).contains("401"), "{}", text(&gated));
    let token_file = scene.dir.path().join(".cache/huggingface/token");
    std::fs::create_dir_all(token_file.parent().unwrap()).unwrap();
    std::fs::write(&token_file, "hf_secret\n").unwrap();
    let with_token = scene.pull(&hosts, "test/m-GGUF", &[]);
    assert!(with_token.status.success(), "the hub's token file is read: {}", text(&with_token));

    let no_repo = scene.pull(&hosts, "test/nothing-GGUF", &[]);
    assert!(text(&no_repo).contains("not found"), "{}", text(&no_repo));
    let no_quant = scene.pull(&hosts, "test/m-GGUF:Q2_K", &[]);
    assert!(text(&no_quant).contains("has no Q2_K file; it has F16"), "{}", text(&no_quant));
    let no_model = scene.pull(&hosts, "nothing:7b", &[]);
    assert!(text(&no_model).contains("nothing:7b") && text(&no_model).contains("not found"), "{}", text(&no_model));
}

#[test]
fn a_killed_pull_run_again_fetches_no_finished_range_twice_and_a_changed_file_starts_again() {
    let (scene, files, mut world) = hub_repo("test/m-GGUF", false);
    let bytes = read(&files[0]);
    world.gate = Some(3);
    let hosts = Hosts::start(world);
    let mut cmd = common::sluice_command();
    cmd.args(["pull", "test/m-GGUF", "--progress", "lines", "--chunk-kib", "256", "--connections", "1", "--no-plan"])
        .env("HF_HUB_CACHE", scene.hub_cache())
        .env("HF_ENDPOINT", &hosts.url)
        .env("HOME", scene.dir.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let mut child = cmd.spawn().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while hosts.with(|w| w.ranges.len()) < 4 {
        assert!(std::time::Instant::now() < deadline, "the pull never reached its fourth range");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    hosts.with(|w| {
        w.gate = None;
        w.ranges.clear();
    });
    let out = scene.pull(&hosts, "test/m-GGUF", &["--connections", "1", "--no-plan"]);
    assert!(out.status.success(), "{}", text(&out));
    let ranges = hosts.with(|w| w.ranges.clone());
    assert!(ranges.iter().all(|&(from, _)| from >= 3 * 256 * 1024), "ranges fetched again: {ranges:?}");
    assert_eq!(read(&scene.snapshot("test/m-GGUF", "F16/m-F16.gguf")), bytes);

    // The host's file changes between two attempts: the first attempt's partial file is for
    // other bytes and is dropped; the new file is fetched whole.
    let mut changed = bytes.clone();
    let last = changed.len() - 1;
    changed[last] ^= 1;
    hosts.with(|w| {
        w.add_repo(
            "test/m-GGUF",
            "1111111111111111111111111111111111111111",
            vec![("F16/m-F16.gguf".into(), changed.clone())],
        );
        w.gate = Some(2);
        w.ranges.clear();
    });
    let mut child = cmd.spawn().unwrap();
    while hosts.with(|w| w.ranges.len()) < 3 {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(!leftovers(&scene.hub_cache(), ".sluice-partial").is_empty(), "the killed pull left its partial file");
    hosts.with(|w| {
        w.add_repo(
            "test/m-GGUF",
            "2222222222222222222222222222222222222222",
            vec![("F16/m-F16.gguf".into(), bytes.clone())],
        );
        w.gate = None;
    });
    let out = scene.pull(&hosts, "test/m-GGUF", &[]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(leftovers(&scene.hub_cache(), ".sluice-partial").is_empty(), "the stale partial file was dropped");
    let _ = sha256_hex(&changed);
}

#[test]
fn an_ollama_model_is_pulled_into_ollamas_layout_and_runs_by_name() {
    let scene = Scene::new();
    let model_file = match std::env::var_os("SLUICE_TRAINED_MODEL").filter(|p| !p.is_empty()) {
        Some(p) => PathBuf::from(p),
        None => model(scene.dir.path(), false).remove(0),
    };
    let gguf = read(&model_file);
    let mut world = World::default();
    world.add_ollama(
        "library/kjv:small",
        vec![
            ("application/vnd.ollama.image.model", gguf.clone()),
            ("application/vnd.ollama.image.template", b"{{ .Prompt }}".to_vec()),
            ("application/vnd.ollama.image.params", b"{\"stop\":[\"</s>\"]}".to_vec()),
        ],
    );
    let hosts = Hosts::start(world);
    let out = scene.pull(&hosts, "kjv:small", &[]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains(": fits"), "the verdict before the download: {}", text(&out));
    let blob = scene.ollama().join("blobs").join(format!("sha256-{}", sha256_hex(&gguf)));
    assert_eq!(read(&blob), gguf);
    let manifest = scene.ollama().join("manifests/registry.ollama.ai/library/kjv/small");
    let m: serde_json::Value = serde_json::from_slice(&read(&manifest)).unwrap();
    assert_eq!(m["layers"].as_array().unwrap().len(), 3);
    for l in m["layers"].as_array().unwrap() {
        let hex = l["digest"].as_str().unwrap().trim_start_matches("sha256:");
        assert!(scene.ollama().join("blobs").join(format!("sha256-{hex}")).is_file(), "layer {hex}");
    }
    let plan = scene.sluice(&hosts, &["plan", "--model", "kjv:small", "--board", "generic", "--ctx", "64"]);
    assert!(plan.status.success(), "{}", text(&plan));
    let listed = text(&scene.sluice(&hosts, &["models"]));
    assert!(listed.contains("kjv:small"), "{listed}");
    let rm = scene.sluice(&hosts, &["models", "--rm", "kjv:small"]);
    assert!(rm.status.success(), "{}", text(&rm));
    assert!(!blob.exists() && !manifest.exists());
    let run = scene
        .sluice(&hosts, &["run", "--model", "kjv:small", "--pull", "--prompt", "In the beginning", "--n-predict", "2"]);
    assert!(run.status.success(), "run --pull fetches a name not stored, then runs it: {}", text(&run));
    assert_eq!(read(&blob), gguf);
}

#[test]
fn a_filesystem_too_small_is_refused_before_the_first_byte() {
    let (scene, _, world) = hub_repo("test/m-GGUF", false);
    let hosts = Hosts::start(world);
    let small = scene.dir.path().join("small");
    std::fs::create_dir_all(&small).unwrap();
    let mounted =
        std::process::Command::new("mount").args(["-t", "tmpfs", "-o", "size=256k", "tmpfs"]).arg(&small).status();
    if !mounted.is_ok_and(|s| s.success()) {
        eprintln!("skipped: mounting a 256 KiB tmpfs needs root");
        return;
    }
    let out = scene.pull(&hosts, "test/m-GGUF", &["--hf-cache", small.to_str().unwrap()]);
    let _ = std::process::Command::new("umount").arg(&small).status();
    assert!(!out.status.success());
    let t = text(&out);
    assert!(t.contains("needs") && t.contains("free"), "both figures: {t}");
    assert!(hosts.with(|w| w.ranges.is_empty()), "not a byte was fetched");
}

/// A server on `served` (its path) whose store holds a hub model pulled beforehand, and whose
/// pulls go to `hosts`.
fn store_server(scene: &Scene, hosts: &Hosts, served: &Path, extra: &[&str]) -> serving::Server {
    let hub = scene.hub_cache();
    let ollama = scene.ollama();
    let env = [
        ("HF_HUB_CACHE", hub.to_str().unwrap()),
        ("OLLAMA_MODELS", ollama.to_str().unwrap()),
        ("HF_ENDPOINT", hosts.url.as_str()),
        ("SLUICE_OLLAMA_REGISTRY", hosts.url.as_str()),
    ];
    let mut args = vec!["--model-id", "m"];
    args.extend_from_slice(extra);
    let mut server = serving::Server::start_with_env(scene.dir.path(), served, &args, &env);
    server.wait_note("READY=1");
    server
}

/// Two models with chat templates on the hosts: `kjv:small` in the registry and `test/m-GGUF`
/// on the hub (pulled into the store beforehand); the server starts on a third, by path.
fn three_models(scene: &Scene) -> (Hosts, PathBuf) {
    let dir = scene.dir.path();
    let (a, b, c) = (dir.join("a"), dir.join("b"), dir.join("c"));
    for d in [&a, &b, &c] {
        std::fs::create_dir_all(d).unwrap();
    }
    let served = serving::synth(&a);
    let registry_model = read(&serving::synth_qwen3(&b));
    let hub_model = read(&serving::synth_with(&c, None));
    let mut world = World::default();
    world.add_ollama("library/kjv:small", vec![("application/vnd.ollama.image.model", registry_model)]);
    world.add_repo("test/m-GGUF", COMMIT, vec![("m-F16.gguf".into(), hub_model)]);
    let hosts = Hosts::start(world);
    let out = scene.pull(&hosts, "test/m-GGUF", &[]);
    assert!(out.status.success(), "{}", text(&out));
    hosts.with(|w| w.ranges.clear());
    (hosts, served)
}

#[test]
fn home_assistant_and_open_webui_pull_list_chat_and_switch_through_the_ollama_client() {
    let scene = Scene::new();
    let (hosts, served) = three_models(&scene);
    let python = std::env::var("SLUICE_OPENAI_PYTHON").unwrap_or_else(|_| "python3".into());
    if common::emulated()
        || !std::process::Command::new(&python).args(["-c", "import ollama"]).output().is_ok_and(|o| o.status.success())
    {
        eprintln!("skipped: {python} cannot import ollama (make test installs it; or set SLUICE_OPENAI_PYTHON)");
        return;
    }
    let server = store_server(&scene, &hosts, &served, &[]);
    let script = format!("{}/../scripts/ollama-store-check.py", env!("CARGO_MANIFEST_DIR"));
    let o = std::process::Command::new(&python)
        .args([&script, &format!("http://{}", server.addr), "m", "kjv:small", "hf.co/test/m-GGUF:F16"])
        .output()
        .unwrap();
    let out = text(&o);
    assert!(out.contains("ollama-store-check: 13 passed, 0 failed"), "{out}\n{}", server.log());
}

#[test]
fn pulls_the_settings_do_not_allow_are_refused_in_ollamas_shape() {
    let scene = Scene::new();
    let (hosts, served) = three_models(&scene);
    let keyed = store_server(&scene, &hosts, &served, &["--max-model-mb", "1"]);
    let pull = |server: &serving::Server, name: &str| {
        let body = format!("{{\"model\":\"{name}\"}}");
        serving::request(server.addr, "POST", "/api/pull", Some(&body))
    };
    let too_big = pull(&keyed, "kjv:small");
    assert_eq!(too_big.status, 400, "{}", too_big.body);
    assert!(too_big.json()["error"].as_str().unwrap().contains("more than the 1.0 MiB"), "{}", too_big.body);
    let nowhere = pull(&keyed, "nothing:7b");
    assert_eq!(nowhere.status, 404, "{}", nowhere.body);
    assert!(nowhere.json()["error"].as_str().unwrap().contains("nothing:7b"), "{}", nowhere.body);
    let url = pull(&keyed, "https://example.com/x.gguf");
    assert_eq!(url.status, 400, "a URL is never fetched: {}", url.body);
    assert!(hosts.with(|w| w.ranges.is_empty()), "nothing was fetched");
    drop(keyed);

    let off = store_server(&scene, &hosts, &served, &["--pull=false"]);
    let refused = pull(&off, "kjv:small");
    assert_eq!(refused.status, 403, "{}", refused.body);
    assert!(refused.json()["error"].as_str().unwrap().contains("pull = false"), "{}", refused.body);
    drop(off);

    let env = [("SLUICE_API_KEY", "k"), ("HF_HUB_CACHE", ""), ("SLUICE_OLLAMA_REGISTRY", hosts.url.as_str())];
    let mut locked = serving::Server::start_with_env(scene.dir.path(), &served, &[], &env);
    locked.wait_note("READY=1");
    let unkeyed = pull(&locked, "kjv:small");
    assert_eq!(unkeyed.status, 401, "{}", unkeyed.body);
    assert!(unkeyed.json()["error"].is_string(), "{}", unkeyed.body);
    assert!(hosts.with(|w| w.ranges.is_empty()), "nothing was fetched");
}

/// The plan's JSON ledger without what the process measures of itself (its memory before
/// loading, and the total that counts it) and the model's path.
fn comparable_plan(o: &Output) -> serde_json::Value {
    assert!(o.status.success(), "{}", text(o));
    let mut v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let m = v.as_object_mut().unwrap();
    m.remove("model");
    m.remove("total");
    m["lines"].as_array_mut().unwrap().retain(|l| l["item"] != "runtime_overhead");
    v
}

#[test]
fn a_model_not_yet_stored_is_planned_from_its_headers_alone_as_the_stored_file_is() {
    let (scene, files, world) = hub_repo("test/split-GGUF", true);
    let total: u64 = files.iter().map(|f| std::fs::metadata(f).unwrap().len()).sum();
    let hosts = Hosts::start(world);
    // A board of a fixed budget: this machine's free memory changes between the two plans.
    let board = scene.dir.path().join("board.toml");
    std::fs::write(&board, "name = \"fixed\"\n[memory]\nbudget_mib = 4096\n").unwrap();
    let plan = ["plan", "--model", "test/split-GGUF:F16", "--board", board.to_str().unwrap(), "--json"];
    let remote = scene.sluice(&hosts, &plan);
    let fetched: u64 = hosts.with(|w| w.ranges.iter().map(|(a, b)| b - a + 1).sum());
    let ranges = hosts.with(|w| w.ranges.clone());
    assert!(ranges.iter().all(|r| r.0 == 0 && r.1 < 1 << 20), "only the files' first MiB is read: {ranges:?}");
    assert!(fetched < total, "the headers alone: {fetched} of {total} bytes");
    assert!(text(&remote).contains("planned from its GGUF headers alone"), "{}", text(&remote));
    let text_plan = scene.sluice(&hosts, &plan[..5]);
    assert!(text(&text_plan).contains("storage bound"), "{}", text(&text_plan));
    assert!(text(&text_plan).contains("ledger for test/split-GGUF:F16"), "{}", text(&text_plan));

    let pulled = scene.pull(&hosts, "test/split-GGUF:F16", &[]);
    assert!(pulled.status.success(), "{}", text(&pulled));
    assert!(text(&pulled).contains("fits"), "the pull says whether it fits first: {}", text(&pulled));
    let stored = scene.sluice(&hosts, &plan);
    assert_eq!(comparable_plan(&remote), comparable_plan(&stored), "the header's plan differs from the stored file's");
}
