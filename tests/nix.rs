//! The Nix appliance stays consistent with the product: the flake's lock pins every input
//! of `flake.nix` in the shape Nix writes, and the NixOS module knows every configuration
//! key (typed options in `nix/settings-options.nix`) and every secret (credential options
//! from `nix/credentials.nix`) that the binary's `check-config --reference` lists.
//!
//! These read the files as text and JSON; nothing here needs Nix (`nix/check.sh` parses and
//! evaluates the `.nix` files where `nix-instantiate` is installed).

// A panic is how a test fails.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_gitea-dynamic-runner");

fn read(relative: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(relative);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The `<name>.url = "<flake ref>";` lines of flake.nix's `inputs`, as name → ref.
fn flake_inputs(flake_nix: &str) -> BTreeMap<String, String> {
    let start = flake_nix
        .find("inputs = {")
        .expect("flake.nix has an `inputs = {` block");
    let block = &flake_nix[start..];
    let end = block.find("\n  };").expect("the inputs block ends");
    block[..end]
        .lines()
        .filter_map(|line| {
            let line = line.trim();
            let (name, rest) = line.split_once(".url = \"")?;
            let url = rest.strip_suffix("\";")?;
            Some((name.to_string(), url.to_string()))
        })
        .collect()
}

/// The keys `check-config --reference` documents (lines `  <key> / <ENV>  [...]`).
fn reference_keys() -> BTreeSet<String> {
    let out = Command::new(BIN)
        .args(["check-config", "--reference"])
        .env_clear()
        .output()
        .expect("the binary runs");
    assert!(out.status.success(), "check-config --reference failed");
    let text = String::from_utf8(out.stdout).expect("utf-8");
    let keys: BTreeSet<String> = text
        .lines()
        .filter_map(|line| {
            let rest = line.strip_prefix("  ")?;
            let (key, rest) = rest.split_once(" / ")?;
            let (env, _) = rest.split_once("  [")?;
            (env == key.to_ascii_uppercase()).then(|| key.to_string())
        })
        .collect();
    assert!(
        keys.len() > 20,
        "too few keys parsed from the reference: {keys:?}"
    );
    keys
}

/// Option names in nix/settings-options.nix, with the text of each option's definition.
fn settings_options() -> BTreeMap<String, String> {
    let text = read("nix/settings-options.nix");
    let mut options = BTreeMap::new();
    let mut current: Option<(String, String)> = None;
    for line in text.lines() {
        if let Some(name) = line
            .strip_prefix("  ")
            .and_then(|l| l.strip_suffix(" = lib.mkOption {"))
        {
            assert!(current.is_none(), "option {name} starts inside another");
            current = Some((name.to_string(), String::new()));
        } else if line == "  };" {
            let (name, body) = current.take().expect("`};` closes an option");
            assert!(
                options.insert(name.clone(), body).is_none(),
                "option {name} defined twice"
            );
        } else if let Some((_, body)) = current.as_mut() {
            body.push_str(line.trim());
            body.push('\n');
        }
    }
    assert!(current.is_none(), "the last option is not closed");
    options
}

/// `key = "…";` values of nix/credentials.nix's `secrets` entries and its `public` list.
fn credential_table() -> (Vec<String>, Vec<String>) {
    let text = read("nix/credentials.nix");
    let (secrets_part, public_part) = text
        .split_once("public = [")
        .expect("credentials.nix has a `public` list");
    let secrets = secrets_part
        .lines()
        .filter_map(|l| {
            let rest = l.trim().strip_prefix("{ key = \"")?;
            Some(rest.split_once('"')?.0.to_string())
        })
        .collect();
    let public = public_part
        .lines()
        .take_while(|l| !l.trim().starts_with(']'))
        .filter_map(|l| Some(l.trim().strip_prefix('"')?.strip_suffix('"')?.to_string()))
        .collect();
    (secrets, public)
}

fn is_sha1_hex(s: &str) -> bool {
    s.len() == 40
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Nix's SRI form of a SHA-256: `sha256-` and 44 base64 characters ending in one `=`.
fn is_sri_sha256(s: &str) -> bool {
    let Some(b64) = s.strip_prefix("sha256-") else {
        return false;
    };
    b64.len() == 44
        && b64.ends_with('=')
        && !b64[..43].contains('=')
        && b64[..43]
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'+' || b == b'/')
}

fn is_github_name(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
}

#[test]
fn flake_lock_is_version_7_json_with_a_root_node() {
    let lock: Value = serde_json::from_str(&read("flake.lock")).expect("flake.lock is JSON");
    assert_eq!(lock["version"], 7, "lock file format version");
    let root = lock["root"].as_str().expect("`root` names the root node");
    assert!(
        lock["nodes"][root]["inputs"].is_object(),
        "the root node {root:?} has inputs"
    );
}

#[test]
fn flake_lock_locks_exactly_the_inputs_flake_nix_declares_with_the_same_source() {
    let inputs = flake_inputs(&read("flake.nix"));
    assert!(
        inputs.contains_key("nixpkgs") && inputs.contains_key("crane"),
        "flake.nix inputs: {inputs:?}"
    );
    let lock: Value = serde_json::from_str(&read("flake.lock")).unwrap();
    let root = lock["root"].as_str().unwrap();
    let locked_inputs = lock["nodes"][root]["inputs"].as_object().unwrap();
    assert_eq!(
        locked_inputs.keys().cloned().collect::<BTreeSet<_>>(),
        inputs.keys().cloned().collect::<BTreeSet<_>>(),
        "inputs of flake.nix vs inputs of the lock's root node"
    );
    for (name, url) in &inputs {
        let node_name = locked_inputs[name]
            .as_str()
            .unwrap_or_else(|| panic!("root input {name} points to a node by name"));
        let original = &lock["nodes"][node_name]["original"];
        // github:<owner>/<repo>[/<ref>]
        let path = url
            .strip_prefix("github:")
            .unwrap_or_else(|| panic!("{name}: only github: inputs are expected, got {url}"));
        let parts: Vec<&str> = path.splitn(3, '/').collect();
        assert_eq!(original["type"], "github", "{name}: original type");
        assert_eq!(original["owner"], parts[0], "{name}: original owner");
        assert_eq!(original["repo"], parts[1], "{name}: original repo");
        match parts.get(2) {
            Some(reference) => assert_eq!(original["ref"], *reference, "{name}: original ref"),
            None => assert!(original.get("ref").is_none(), "{name}: no ref in flake.nix"),
        }
    }
}

#[test]
fn every_locked_github_node_pins_a_full_revision_and_an_sri_nar_hash() {
    let lock: Value = serde_json::from_str(&read("flake.lock")).unwrap();
    let root = lock["root"].as_str().unwrap();
    let nodes = lock["nodes"].as_object().unwrap();
    assert!(nodes.len() >= 3, "root plus at least nixpkgs and crane");
    for (name, node) in nodes {
        if name == root {
            continue;
        }
        let locked = &node["locked"];
        assert_eq!(locked["type"], "github", "{name}: locked type");
        for field in ["owner", "repo"] {
            let value = locked[field].as_str().unwrap_or_default();
            assert!(is_github_name(value), "{name}: locked {field} {value:?}");
            assert_eq!(locked[field], node["original"][field], "{name}: {field}");
        }
        let rev = locked["rev"].as_str().unwrap_or_default();
        assert!(
            is_sha1_hex(rev),
            "{name}: rev {rev:?} is not 40 lowercase hex digits"
        );
        let nar_hash = locked["narHash"].as_str().unwrap_or_default();
        assert!(is_sri_sha256(nar_hash), "{name}: narHash {nar_hash:?}");
        assert!(
            locked["lastModified"]
                .as_u64()
                .is_some_and(|t| t > 1_600_000_000),
            "{name}: lastModified is a plausible Unix time"
        );
        assert!(
            node["original"].get("rev").is_none(),
            "{name}: flake.nix must not pin a rev by hand; the lock does"
        );
    }
}

#[test]
fn the_module_has_one_typed_option_for_every_configuration_key_the_binary_documents() {
    let options = settings_options();
    let names: BTreeSet<String> = options.keys().cloned().collect();
    let reference = reference_keys();
    let missing: Vec<_> = reference.difference(&names).collect();
    let extra: Vec<_> = names.difference(&reference).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "nix/settings-options.nix is out of step with `check-config --reference` \
         (regenerate it): missing {missing:?}, unknown {extra:?}"
    );
    assert!(
        options["nats_url"].contains("single-host mode")
            && !options["nats_url"].contains("not implemented"),
        "nats_url: unset means the implemented single-host mode:\n{}",
        options["nats_url"]
    );
    for (name, body) in &options {
        assert!(
            body.starts_with("type = lib.types.nullOr "),
            "{name}: type must be lib.types.nullOr …:\n{body}"
        );
        assert!(
            body.contains("\ndefault = null;\n"),
            "{name}: default = null:\n{body}"
        );
        assert!(
            body.contains("\ndescription = \""),
            "{name}: a description:\n{body}"
        );
    }
}

/// DESIGN invariant 17: secrets come only from files, so every file key is classified and
/// every secret file reaches the service through LoadCredential, never the Nix store.
#[test]
fn every_file_key_of_the_binary_is_either_a_module_credential_or_declared_public() {
    let (secrets, public) = credential_table();
    assert!(!secrets.is_empty() && !public.is_empty());
    let mut seen = BTreeSet::new();
    for key in secrets.iter().chain(&public) {
        assert!(
            seen.insert(key.clone()),
            "{key} listed twice in nix/credentials.nix"
        );
    }
    let reference = reference_keys();
    let file_keys: BTreeSet<String> = reference
        .iter()
        .filter(|k| k.ends_with("_file") || k.ends_with("_files"))
        .cloned()
        .collect();
    let unclassified: Vec<_> = file_keys.difference(&seen).collect();
    assert!(
        unclassified.is_empty(),
        "file keys without a credential option or a `public` entry in nix/credentials.nix: \
         {unclassified:?}"
    );
    let unknown: Vec<_> = seen.difference(&reference).collect();
    assert!(
        unknown.is_empty(),
        "nix/credentials.nix names keys the binary does not have: {unknown:?}"
    );
}
