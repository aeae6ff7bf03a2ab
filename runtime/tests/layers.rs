//! The runtime's layering as docs/architecture.md draws it: no module of `runtime/src` imports
//! a module of its own layer or one above, every top-level module has a layer, no source file is
//! over 450 lines and no function over 80.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Each top-level module of the crate and its layer (docs/architecture.md); the binary (`cli`,
/// `main.rs`) and the crate root sit above them all and are not checked.
const LAYERS: &[(&str, u32)] = &[
    ("text", 1),
    ("units", 1),
    ("framed", 1),
    ("lossy", 1),
    ("dirs", 1),
    ("metadata", 2),
    ("generate", 3),
    ("perplexity", 3),
    ("stream", 4),
    ("synth", 4),
    ("board", 5),
    ("demo", 5),
    ("budget", 6),
    ("systemd", 6),
    ("scaleout", 7),
    ("launch", 8),
    ("telemetry", 8),
    ("serve", 9),
    ("bench", 9),
    ("replay", 10),
];

/// The most lines a source file may have.
const MAX_FILE_LINES: usize = 450;
/// The most lines a function may have, its signature and closing brace included.
const MAX_FN_LINES: usize = 80;

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `.rs` file under `dir`.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    out.sort();
    out
}

/// The top-level module a file of `runtime/src` belongs to (`stream` for `stream/io/lane.rs`).
fn top_module(file: &Path) -> String {
    let rel = file.strip_prefix(src()).unwrap();
    let first = rel.components().next().unwrap().as_os_str().to_string_lossy().into_owned();
    first.strip_suffix(".rs").map(str::to_string).unwrap_or(first)
}

/// A Rust source with its comments, strings and character literals blanked out (newlines and
/// lengths kept), so that braces and paths are only those of the code.
fn code_only(text: &str) -> String {
    let b: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let blank = |c: char| if c == '\n' { '\n' } else { ' ' };
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        let prev_ident = i > 0 && (b[i - 1].is_alphanumeric() || b[i - 1] == '_');
        if c == '/' && next == Some('/') {
            while i < b.len() && b[i] != '\n' {
                out.push(' ');
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == '/' && b.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if b[i] == '*' && b.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(blank(b[i]));
                    i += 1;
                }
            }
        } else if c == 'r' && !prev_ident && matches!(next, Some('"') | Some('#')) {
            // A raw string: r"..." or r#"..."#.
            let mut j = i + 1;
            while b.get(j) == Some(&'#') {
                j += 1;
            }
            if b.get(j) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            let hashes = j - i - 1;
            let closing: Vec<char> = std::iter::once('"').chain(std::iter::repeat_n('#', hashes)).collect();
            out.extend(std::iter::repeat_n(' ', j + 1 - i));
            i = j + 1;
            while i < b.len() && b[i..].iter().take(closing.len()).ne(closing.iter()) {
                out.push(blank(b[i]));
                i += 1;
            }
            out.extend(std::iter::repeat_n(' ', closing.len().min(b.len() - i)));
            i += closing.len();
        } else if c == '"' {
            out.push(' ');
            i += 1;
            while i < b.len() && b[i] != '"' {
                if b[i] == '\\' {
                    out.push(' ');
                    i += 1;
                }
                if i < b.len() {
                    out.push(blank(b[i]));
                    i += 1;
                }
            }
            out.push(' ');
            i += 1;
        } else if c == '\'' && next == Some('\\') {
            // An escaped character literal.
            out.push(' ');
            i += 2;
            while i < b.len() && b[i] != '\'' {
                out.push(' ');
                i += 1;
            }
            out.push_str("  ");
            i += 1;
        } else if c == '\'' && b.get(i + 2) == Some(&'\'') {
            out.push_str("   ");
            i += 3;
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// The top-level modules `code` names through `crate::` (in paths and in `use crate::{...}`).
fn crate_uses(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let ident = |s: &str| s.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect::<String>();
    for (at, _) in code.match_indices("crate::") {
        let rest = &code[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // The first identifier of each item at the group's top level.
            let mut depth = 0;
            let mut item = String::new();
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        out.insert(ident(item.trim()));
                        item.clear();
                    }
                    c if depth == 0 => item.push(c),
                    _ => {}
                }
            }
            out.insert(ident(item.trim()));
        } else {
            out.insert(ident(rest));
        }
    }
    out.retain(|m| !m.is_empty() && m != "self");
    out
}

fn layer_of(module: &str) -> Option<u32> {
    LAYERS.iter().find(|(m, _)| *m == module).map(|&(_, l)| l)
}

#[test]
fn no_module_imports_its_own_layer_or_one_above() {
    let mut reaching_up = Vec::new();
    for file in rust_files(&src()) {
        let module = top_module(&file);
        if matches!(module.as_str(), "cli" | "main" | "lib") {
            continue;
        }
        let layer = layer_of(&module).unwrap_or_else(|| {
            panic!("{}: module {module} has no layer in LAYERS (docs/architecture.md)", file.display())
        });
        let code = code_only(&std::fs::read_to_string(&file).unwrap());
        for used in crate_uses(&code) {
            if used == module {
                continue;
            }
            let Some(used_layer) = layer_of(&used) else { continue };
            if used_layer >= layer {
                reaching_up
                    .push(format!("{} ({module}, layer {layer}) uses {used} (layer {used_layer})", file.display()));
            }
        }
    }
    assert!(reaching_up.is_empty(), "imports that reach up or sideways:\n{}", reaching_up.join("\n"));
}

#[test]
fn every_top_level_module_has_a_layer() {
    let lib = std::fs::read_to_string(src().join("lib.rs")).unwrap();
    for line in lib.lines() {
        if let Some(name) = line.strip_prefix("pub mod ").and_then(|r| r.strip_suffix(';')) {
            assert!(layer_of(name).is_some(), "module {name} has no layer in LAYERS (docs/architecture.md)");
        }
    }
}

#[test]
fn source_files_and_functions_stay_short() {
    let mut long = Vec::new();
    for file in rust_files(&src()) {
        let text = std::fs::read_to_string(&file).unwrap();
        let lines = text.lines().count();
        if lines > MAX_FILE_LINES {
            long.push(format!("{}: {lines} lines (at most {MAX_FILE_LINES})", file.display()));
        }
        for (name, first, n) in functions(&code_only(&text)) {
            if n > MAX_FN_LINES {
                long.push(format!("{}:{first}: fn {name} has {n} lines (at most {MAX_FN_LINES})", file.display()));
            }
        }
    }
    assert!(long.is_empty(), "too long:\n{}", long.join("\n"));
}

/// Every function with a body in `code` (comments and strings blanked): its name, its first
/// line (1-based) and its length in lines.
fn functions(code: &str) -> Vec<(String, usize, usize)> {
    let chars: Vec<char> = code.chars().collect();
    let line_at = |i: usize| chars[..i].iter().filter(|&&c| c == '\n').count() + 1;
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(pos) = code[from..].find("fn ").map(|p| p + from) {
        from = pos + 3;
        let before = code[..pos].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let name: String = code[pos + 3..].chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        if name.is_empty() {
            continue;
        }
        // The body: the first `{` at depth 0 of parentheses and angle-free signature text, unless
        // a `;` ends the declaration first.
        let rest = &code[pos..];
        let (Some(open), semi) = (rest.find('{'), rest.find(';')) else { continue };
        if semi.is_some_and(|s| s < open) {
            continue;
        }
        let start = code[..pos].chars().count();
        let open_at = start + code[pos..pos + open].chars().count();
        let mut depth = 0;
        let mut end = open_at;
        for (k, &c) in chars.iter().enumerate().skip(open_at) {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = k;
                        break;
                    }
                }
                _ => {}
            }
        }
        let (first, last) = (line_at(start), line_at(end));
        out.push((name, first, last - first + 1));
    }
    out
}

#[test]
fn the_checks_read_code_not_comments_or_strings() {
    let code = code_only("let a = \"crate::serve {\"; // crate::bench {\nuse crate::{stream::X, board::{Y, Z}};\n");
    assert_eq!(crate_uses(&code), BTreeSet::from(["board".to_string(), "stream".to_string()]));
    let f = functions(&code_only("fn a() {\n    let c = '{';\n    r#\"}\"#;\n}\nfn b();\nfn c() {}\n"));
    assert_eq!(f, [("a".to_string(), 1, 4), ("c".to_string(), 6, 1)]);
}
