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
    ("store", 5),
    ("budget", 6),
    ("systemd", 6),
    ("pull", 6),
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

/// Every path `code` names from the crate's root, its parent or itself (`crate::`, `super::`,
/// `self::`), `use` groups expanded, as absolute module paths: the file's own module path is
/// `module`, and paths stop at the first segment that is not an identifier.
fn module_paths(code: &str, module: &[String]) -> Vec<Vec<String>> {
    let chars: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let starts =
            ["crate::", "super::", "self::"].iter().find(|p| chars[i..].iter().take(p.len()).copied().eq(p.chars()));
        let before = i.checked_sub(1).map(|j| chars[j]);
        match starts {
            Some(_) if !before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') => {
                let (paths, end) = expand(&chars, i);
                for path in paths {
                    if let Some(abs) = absolute(&path, module) {
                        out.push(abs);
                    }
                }
                i = end.max(i + 1);
            }
            _ => i += 1,
        }
    }
    out
}

/// The paths of one (possibly grouped) path starting at `at`, and where it ends.
fn expand(chars: &[char], at: usize) -> (Vec<Vec<String>>, usize) {
    let mut segments = Vec::new();
    let mut i = at;
    loop {
        let ident: String = chars[i..].iter().take_while(|c| c.is_alphanumeric() || **c == '_').collect();
        if ident.is_empty() {
            if chars.get(i) == Some(&'{') {
                let mut out = Vec::new();
                i += 1;
                loop {
                    while chars.get(i).is_some_and(|c| c.is_whitespace() || *c == ',') {
                        i += 1;
                    }
                    if i >= chars.len() || chars[i] == '}' {
                        return (out, i + 1);
                    }
                    let (inner, end) = expand(chars, i);
                    out.extend(inner.into_iter().map(|p| segments.iter().cloned().chain(p).collect()));
                    i = end;
                    // Skip an `as` rename or anything else up to the next item.
                    while i < chars.len() && chars[i] != ',' && chars[i] != '}' {
                        i += 1;
                    }
                }
            }
            return (vec![segments], i);
        }
        i += ident.chars().count();
        segments.push(ident);
        if chars[i..].starts_with(&[':', ':']) {
            i += 2;
        } else {
            return (vec![segments], i);
        }
    }
}

/// `path` (from `crate`, `super` or `self`) as a path from the crate's root, seen from `module`.
fn absolute(path: &[String], module: &[String]) -> Option<Vec<String>> {
    let mut base: Vec<String> = module.to_vec();
    let mut rest = path;
    match rest.first().map(String::as_str) {
        Some("crate") => {
            base.clear();
            rest = &rest[1..];
        }
        Some("self") => rest = &rest[1..],
        Some("super") => {
            while rest.first().is_some_and(|s| s == "super") {
                base.pop()?;
                rest = &rest[1..];
            }
        }
        _ => return None,
    }
    base.extend(rest.iter().filter(|s| *s != "self").cloned());
    Some(base)
}

/// A file's module path under `runtime/src` (`["serve", "http", "body"]` for
/// `serve/http/body.rs`; a folder's `mod.rs` is the folder's module).
fn module_of(file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src()).unwrap().with_extension("");
    let mut path: Vec<String> = rel.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
    if path.last().is_some_and(|l| l == "mod" || l == "lib" || l == "main") {
        path.pop();
    }
    path
}

/// The modules declared as children of `module` (its files and folders).
fn children(module: &[String]) -> BTreeSet<String> {
    let dir = module.iter().fold(src(), |d, s| d.join(s));
    let mut out = BTreeSet::new();
    let Ok(entries) = std::fs::read_dir(&dir) else { return out };
    for entry in entries {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        if path.is_dir() || (path.extension().is_some_and(|e| e == "rs") && name != "mod") {
            out.insert(name);
        }
    }
    out
}

/// Each folder's uses between its children: for every file, at every folder above it, the
/// child of that folder the file lies in and the other children it names (a folder's `mod.rs`
/// is the folder and takes no part: it may use and be used by its children).
fn sibling_uses() -> std::collections::BTreeMap<Vec<String>, BTreeSet<(String, String)>> {
    let mut uses: std::collections::BTreeMap<Vec<String>, BTreeSet<(String, String)>> = Default::default();
    for file in rust_files(&src()) {
        let module = module_of(&file);
        let code = code_only(&std::fs::read_to_string(&file).unwrap());
        let paths = module_paths(&code, &module);
        for depth in 0..module.len() {
            let folder = &module[..depth];
            let from = &module[depth];
            let siblings = children(folder);
            for path in &paths {
                if path.len() > depth
                    && path[..depth] == *folder
                    && path[depth] != *from
                    && siblings.contains(&path[depth])
                {
                    uses.entry(folder.to_vec()).or_default().insert((from.clone(), path[depth].clone()));
                }
            }
        }
    }
    uses
}

/// The circles among `edges`: each strongly connected set of two or more nodes, sorted.
fn circles(edges: &BTreeSet<(String, String)>) -> Vec<Vec<String>> {
    let nodes: BTreeSet<&String> = edges.iter().flat_map(|(a, b)| [a, b]).collect();
    let reaches = |from: &String| {
        let mut seen = BTreeSet::from([from.clone()]);
        let mut todo = vec![from.clone()];
        while let Some(n) = todo.pop() {
            for (_, b) in edges.iter().filter(|(a, _)| *a == n) {
                if seen.insert(b.clone()) {
                    todo.push(b.clone());
                }
            }
        }
        seen
    };
    let mut out: Vec<Vec<String>> = Vec::new();
    for n in nodes {
        let set: Vec<String> = reaches(n).into_iter().filter(|m| reaches(m).contains(n)).collect();
        if set.len() > 1 && !out.contains(&set) {
            out.push(set);
        }
    }
    out
}

#[test]
fn files_of_one_folder_use_each_other_one_way_only() {
    let mut found = Vec::new();
    for (folder, edges) in sibling_uses() {
        for circle in circles(&edges) {
            let arrows: Vec<String> = edges
                .iter()
                .filter(|(a, b)| circle.contains(a) && circle.contains(b))
                .map(|(a, b)| format!("{a} -> {b}"))
                .collect();
            found.push(format!("src/{}: {}", folder.join("/"), arrows.join(", ")));
        }
    }
    assert!(found.is_empty(), "circles between the files of one folder:\n{}", found.join("\n"));
}

#[test]
fn sibling_uses_resolve_crate_super_self_and_groups() {
    let module: Vec<String> = ["serve", "http", "body"].map(String::from).to_vec();
    let code = code_only("use super::{conn::Conn, reply};\nuse crate::serve::{engine, api::{parse, X}};\nlet a = self::inner::f();\nuse super::super::job as j;\n");
    let paths: Vec<String> = module_paths(&code, &module).into_iter().map(|p| p.join("::")).collect();
    assert_eq!(
        paths,
        [
            "serve::http::conn::Conn",
            "serve::http::reply",
            "serve::engine",
            "serve::api::parse",
            "serve::api::X",
            "serve::http::body::inner::f",
            "serve::job"
        ]
    );
    let edges: BTreeSet<(String, String)> =
        [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")].map(|(a, b)| (a.to_string(), b.to_string())).into();
    assert_eq!(circles(&edges), [["a", "b", "c"].map(String::from).to_vec()]);
}
