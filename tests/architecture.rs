//! The shape of the code, checked from its source: no import loop between the modules of a
//! product crate (ARCHITECTURE.md, "Import graph").
//!
//! A module is a file (`foo/mod.rs` is module `foo`, `lib.rs`/`main.rs` the crate root). Its
//! edges are the `crate::…` paths (in `use` trees too) and `super::…` paths of its code; unit
//! tests (`#[cfg(test)]` modules, inline or in their own file) are left out, since a test may
//! reach anything. A loop is reported with every module on it, so whoever closes one sees
//! which import to move behind a port.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// The crates whose code ships in the product: every crate of the workspace but the test kit,
/// and the root package.
fn product_crates() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut crates = vec![root.to_path_buf()];
    let mut members: Vec<PathBuf> = fs::read_dir(root.join("crates"))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.join("src").is_dir())
        .filter(|path| !path.ends_with("gdr-testkit"))
        .collect();
    members.sort();
    crates.extend(members);
    crates
}

/// Every `.rs` file under `dir`, recursively.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            out.push(path);
        }
    }
}

/// The module path of a file below `src`: `["scheduler", "heartbeat"]` for
/// `scheduler/heartbeat.rs`, `["scheduler"]` for `scheduler/mod.rs`, `[]` for the root.
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let relative = file.strip_prefix(src).unwrap().with_extension("");
    let mut segments: Vec<String> = relative
        .iter()
        .map(|part| part.to_string_lossy().into_owned())
        .collect();
    if segments.first().is_some_and(|first| first == "bin") {
        // Each `src/bin/*.rs` is a crate root of its own.
        return vec![format!("bin::{}", segments[1..].join("::"))];
    }
    if segments
        .last()
        .is_some_and(|last| last == "mod" || last == "lib" || last == "main")
    {
        segments.pop();
    }
    segments
}

/// The file's text without comments and without its `#[cfg(test)]` items (a `mod tests { … }`
/// block or a `mod tests;` declaration), so that only product code yields edges.
fn product_code(text: &str) -> String {
    let mut out = String::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let code = strip_line_comment(line);
        if code.trim() == "#[cfg(test)]" {
            // Skip the attributed item: to its `;`, or to the brace that closes its block.
            let mut depth = 0i64;
            let mut opened = false;
            for item in lines.by_ref() {
                let item = strip_line_comment(item);
                for c in item.chars() {
                    match c {
                        '{' => {
                            depth += 1;
                            opened = true;
                        }
                        '}' => depth -= 1,
                        _ => {}
                    }
                }
                if (opened && depth <= 0) || (!opened && item.trim_end().ends_with(';')) {
                    break;
                }
            }
            continue;
        }
        out.push_str(code);
        out.push('\n');
    }
    out
}

/// The line up to a `//` comment (doc comments included: their `crate::` links are not
/// imports). A `//` inside a string literal cuts the rest of that line, which can only lose a
/// path written after a URL on the same line.
fn strip_line_comment(line: &str) -> &str {
    match line.find("//") {
        Some(at) => &line[..at],
        None => line,
    }
}

fn is_ident_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The paths a use tree starting at `text` names, each as its segments: `{a::B, c::{d, e}}`
/// gives `a::B`, `c::d`, `c::e`.
fn use_tree(text: &str, prefix: &[String], out: &mut Vec<Vec<String>>) -> usize {
    let bytes: Vec<char> = text.chars().collect();
    let mut at = 0;
    let mut path = prefix.to_vec();
    loop {
        while at < bytes.len() && bytes[at].is_whitespace() {
            at += 1;
        }
        if at < bytes.len() && bytes[at] == '{' {
            at += 1;
            loop {
                let rest: String = bytes[at..].iter().collect();
                at += use_tree(&rest, &path, out);
                while at < bytes.len() && (bytes[at].is_whitespace() || bytes[at] == ',') {
                    at += 1;
                }
                if at >= bytes.len() || bytes[at] == '}' {
                    return at + 1;
                }
            }
        }
        let start = at;
        while at < bytes.len() && is_ident_char(bytes[at]) {
            at += 1;
        }
        if at > start {
            path.push(bytes[start..at].iter().collect());
        }
        if bytes[at..].starts_with(&[':', ':']) {
            at += 2;
            continue;
        }
        if at == start {
            // `*` or something that is no path segment: the path so far is the edge.
            while at < bytes.len() && !matches!(bytes[at], ',' | '}' | ';') {
                at += 1;
            }
        }
        out.push(path);
        return at;
    }
}

/// Every path in `code` that starts with `anchor` (`crate::` or `super::`) at a word
/// boundary (so not `$crate::`), as its segments after the anchor.
fn anchored_paths(code: &str, anchor: &str) -> Vec<Vec<String>> {
    let mut paths = Vec::new();
    let mut from = 0;
    while let Some(found) = code[from..].find(anchor) {
        let at = from + found;
        from = at + anchor.len();
        let before = code[..at].chars().next_back();
        if before.is_some_and(|c| is_ident_char(c) || c == '$' || c == ':') {
            continue;
        }
        use_tree(&code[from..], &[], &mut paths);
    }
    paths
}

/// The module a path names: its longest prefix that is a module of the crate.
fn target(modules: &BTreeSet<Vec<String>>, path: &[String]) -> Vec<String> {
    (0..=path.len())
        .rev()
        .map(|len| path[..len].to_vec())
        .find(|prefix| modules.contains(prefix))
        .unwrap_or_default()
}

/// The import graph of one crate: module -> the modules its code names.
fn import_graph(crate_dir: &Path) -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
    let src = crate_dir.join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    // A unit test's own file (`foo/tests.rs`, declared `#[cfg(test)] mod tests;`) is test code.
    files.retain(|file| !file.ends_with("tests.rs"));
    let modules: BTreeSet<Vec<String>> = files.iter().map(|file| module_of(&src, file)).collect();
    let mut graph = BTreeMap::new();
    for file in &files {
        let module = module_of(&src, file);
        let code = product_code(&fs::read_to_string(file).unwrap());
        let mut edges = BTreeSet::new();
        for path in anchored_paths(&code, "crate::") {
            edges.insert(target(&modules, &path));
        }
        let parent = module[..module.len().saturating_sub(1)].to_vec();
        for path in anchored_paths(&code, "super::") {
            let mut full = parent.clone();
            let mut segments = path.as_slice();
            // `super::super::x` climbs once more per `super`.
            while segments.first().is_some_and(|s| s == "super") {
                full.pop();
                segments = &segments[1..];
            }
            full.extend_from_slice(segments);
            edges.insert(target(&modules, &full));
        }
        edges.remove(&module);
        graph.insert(module, edges);
    }
    graph
}

type Loop = (Vec<Vec<String>>, Vec<Vec<String>>);

/// Every loop of the graph: one per group of modules that reach each other (a strongly
/// connected component), as one cycle through it (the first module repeated at the end) and
/// the group's other members.
fn find_loops(graph: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>) -> Vec<Loop> {
    // The graphs are a few dozen modules: reachability by search from each is plenty fast.
    let reach = |from: &Vec<String>| {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.clone()];
        while let Some(module) = todo.pop() {
            for next in graph.get(&module).into_iter().flatten() {
                if seen.insert(next.clone()) {
                    todo.push(next.clone());
                }
            }
        }
        seen
    };
    let reachable: BTreeMap<&Vec<String>, BTreeSet<Vec<String>>> =
        graph.keys().map(|module| (module, reach(module))).collect();
    let mut placed = BTreeSet::new();
    let mut loops = Vec::new();
    for (module, from_here) in &reachable {
        if placed.contains(*module) || !from_here.contains(*module) {
            continue;
        }
        let group: BTreeSet<Vec<String>> = from_here
            .iter()
            .filter(|other| {
                reachable
                    .get(other)
                    .is_some_and(|back| back.contains(*module))
            })
            .cloned()
            .collect();
        let cycle = cycle_through(graph, module, &group);
        let others = group
            .iter()
            .filter(|m| !cycle.contains(m))
            .cloned()
            .collect();
        placed.extend(group);
        loops.push((cycle, others));
    }
    loops
}

/// A shortest cycle from `start` back to it inside `group` (breadth-first search).
fn cycle_through(
    graph: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
    start: &Vec<String>,
    group: &BTreeSet<Vec<String>>,
) -> Vec<Vec<String>> {
    let mut came_from: BTreeMap<Vec<String>, Vec<String>> = BTreeMap::new();
    let mut frontier = std::collections::VecDeque::from([start.clone()]);
    while let Some(module) = frontier.pop_front() {
        for next in graph.get(&module).into_iter().flatten() {
            if !group.contains(next) || came_from.contains_key(next) {
                continue;
            }
            came_from.insert(next.clone(), module.clone());
            if next == start {
                let mut cycle = vec![start.clone()];
                let mut at = module.clone();
                while &at != start {
                    cycle.push(at.clone());
                    at = came_from[&at].clone();
                }
                cycle.push(start.clone());
                cycle.reverse();
                return cycle;
            }
            frontier.push_back(next.clone());
        }
    }
    vec![start.clone()]
}

fn show(module: &[String]) -> String {
    if module.is_empty() {
        "crate".to_owned()
    } else {
        module.join("::")
    }
}

#[test]
fn no_product_crate_has_an_import_loop_between_its_modules_so_each_component_depends_on_ports_not_on_its_consumers()
 {
    let mut loops = Vec::new();
    for crate_dir in product_crates() {
        let graph = import_graph(&crate_dir);
        assert!(
            !graph.is_empty(),
            "no module found in {}",
            crate_dir.display()
        );
        for (cycle, others) in find_loops(&graph) {
            let cycle: Vec<String> = cycle.iter().map(|m| show(m)).collect();
            let others: Vec<String> = others.iter().map(|m| show(m)).collect();
            loops.push(format!(
                "{}: {}{}",
                crate_dir.file_name().unwrap().to_string_lossy(),
                cycle.join(" -> "),
                if others.is_empty() {
                    String::new()
                } else {
                    format!(" (same loop, through: {})", others.join(", "))
                }
            ));
        }
    }
    assert!(
        loops.is_empty(),
        "import loops between modules (move the shared types into a module of their own, \
         e.g. a port trait):\n{}",
        loops.join("\n")
    );
}

#[test]
fn the_import_graph_sees_crate_super_and_grouped_paths_and_skips_unit_tests() {
    let code = product_code(
        "use crate::{queue::{A, B}, metrics};\n\
         use super::lease::Lease; // crate::comment::Ignored\n\
         fn f() { crate::wake::Wake::new(); $crate::macro_path::X; }\n\
         #[cfg(test)]\nmod tests {\n    use crate::test_only::X;\n}\n",
    );
    let mut paths = anchored_paths(&code, "crate::");
    paths.sort();
    let expect = |p: &[&str]| p.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    assert_eq!(
        paths,
        vec![
            expect(&["metrics"]),
            expect(&["queue", "A"]),
            expect(&["queue", "B"]),
            expect(&["wake", "Wake", "new"]),
        ]
    );
    assert_eq!(
        anchored_paths(&code, "super::"),
        vec![expect(&["lease", "Lease"])]
    );
    let graph = BTreeMap::from([
        (expect(&["a"]), BTreeSet::from([expect(&["b"])])),
        (expect(&["b"]), BTreeSet::from([expect(&["a"])])),
    ]);
    assert_eq!(
        find_loops(&graph),
        vec![(vec![expect(&["a"]), expect(&["b"]), expect(&["a"])], vec![])]
    );
}
