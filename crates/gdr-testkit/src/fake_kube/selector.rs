//! Label and field selectors as the API server parses them.
//!
//! Labels: equality (`a=b`, `a==b`, `a!=b`), existence (`a`, `!a`) and set-based
//! (`a in (x,y)`, `a notin (x,y)`), comma-separated, all required. Fields: `path=value`,
//! `path==value`, `path!=value` on dotted paths of the object (`spec.nodeName`,
//! `metadata.name`, `status.phase`).

use serde_json::Value;

/// A parsed label selector.
#[derive(Debug, Clone)]
pub struct LabelSelector(Vec<Requirement>);

#[derive(Debug, Clone)]
enum Requirement {
    Eq(String, String),
    Ne(String, String),
    Exists(String),
    Absent(String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

/// Splits on commas outside parentheses (`a in (x,y),b` is two requirements).
fn split_top_level(s: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0i32, 0usize);
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&s[start..]);
    parts
}

fn set_values(part: &str, rest: &str) -> Result<Vec<String>, String> {
    let inner = rest
        .trim()
        .strip_prefix('(')
        .and_then(|r| r.strip_suffix(')'))
        .ok_or_else(|| format!("unable to parse requirement {part:?}: expected a (value,…) set"))?;
    inner
        .split(',')
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .map(|v| check_value(part, v))
        .collect()
}

fn check_key(part: &str, key: &str) -> Result<String, String> {
    let key = key.trim();
    let mut causes = Vec::new();
    super::validate::qualified_name("key", key, &mut causes);
    if key.is_empty() || !causes.is_empty() {
        let why = causes
            .first()
            .map(|c| c.message.clone())
            .unwrap_or_default();
        return Err(format!(
            "unable to parse requirement {part:?}: invalid label key {key:?}: {why}"
        ));
    }
    Ok(key.to_owned())
}

/// A value in a selector must be one a label can have (the server's `400` otherwise).
fn check_value(part: &str, value: &str) -> Result<String, String> {
    let value = value.trim();
    if let Some(why) = super::validate::label_value_problem(value) {
        return Err(format!(
            "unable to parse requirement: values[0][{}]: Invalid value: {value:?}: {why}",
            part.split(['=', '!', ' ']).next().unwrap_or(part).trim()
        ));
    }
    Ok(value.to_owned())
}

impl LabelSelector {
    /// Parses a selector; the error is the real server's 400 message.
    pub fn parse(s: &str) -> Result<Self, String> {
        let mut reqs = Vec::new();
        for part in split_top_level(s)
            .into_iter()
            .map(str::trim)
            .filter(|p| !p.is_empty())
        {
            let req = if let Some((k, rest)) = part.split_once(" notin ") {
                Requirement::NotIn(check_key(part, k)?, set_values(part, rest)?)
            } else if let Some((k, rest)) = part.split_once(" in ") {
                Requirement::In(check_key(part, k)?, set_values(part, rest)?)
            } else if let Some((k, v)) = part.split_once("!=") {
                Requirement::Ne(check_key(part, k)?, check_value(part, v)?)
            } else if let Some((k, v)) = part.split_once("==") {
                Requirement::Eq(check_key(part, k)?, check_value(part, v)?)
            } else if let Some((k, v)) = part.split_once('=') {
                Requirement::Eq(check_key(part, k)?, check_value(part, v)?)
            } else if let Some(k) = part.strip_prefix('!') {
                Requirement::Absent(check_key(part, k)?)
            } else {
                Requirement::Exists(check_key(part, part)?)
            };
            reqs.push(req);
        }
        Ok(LabelSelector(reqs))
    }

    /// Whether `obj`'s labels satisfy every requirement.
    pub fn matches(&self, obj: &Value) -> bool {
        let labels = &obj["metadata"]["labels"];
        let label = |k: &str| labels.get(k).and_then(Value::as_str);
        self.0.iter().all(|r| match r {
            Requirement::Eq(k, v) => label(k) == Some(v.as_str()),
            Requirement::Ne(k, v) => label(k) != Some(v.as_str()),
            Requirement::Exists(k) => label(k).is_some(),
            Requirement::Absent(k) => label(k).is_none(),
            Requirement::In(k, vs) => label(k).is_some_and(|l| vs.iter().any(|v| v == l)),
            Requirement::NotIn(k, vs) => label(k).is_none_or(|l| vs.iter().all(|v| v != l)),
        })
    }
}

/// A parsed field selector.
#[derive(Debug, Clone)]
pub struct FieldSelector(Vec<(String, bool, String)>);

impl FieldSelector {
    /// Parses `path=value` / `path!=value` requirements.
    pub fn parse(s: &str) -> Result<Self, String> {
        let mut reqs = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (path, eq, value) = if let Some((k, v)) = part.split_once("!=") {
                (k, false, v)
            } else if let Some((k, v)) = part.split_once("==") {
                (k, true, v)
            } else if let Some((k, v)) = part.split_once('=') {
                (k, true, v)
            } else {
                return Err(format!("invalid selector: {part:?}; can't understand"));
            };
            reqs.push((path.trim().to_owned(), eq, value.trim().to_owned()));
        }
        Ok(FieldSelector(reqs))
    }

    /// Whether `obj` satisfies every requirement (an absent field reads as "").
    pub fn matches(&self, obj: &Value) -> bool {
        self.0.iter().all(|(path, eq, want)| {
            let got = path
                .split('.')
                .try_fold(obj, |v, seg| v.get(seg))
                .map(|v| match v {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                })
                .unwrap_or_default();
            (got == *want) == *eq
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use serde_json::json;

    use super::*;

    fn obj(labels: Value) -> Value {
        json!({ "metadata": { "labels": labels }, "spec": { "nodeName": "n1" } })
    }

    #[test]
    fn set_based_requirements_match_as_the_api_server_does() {
        let o = obj(json!({ "env": "prod", "tier": "web" }));
        let yes = [
            "env in (prod,qa)",
            "env notin (dev)",
            "missing notin (x)",
            "env,tier=web",
            "env in (prod, qa),tier!=db",
        ];
        for s in yes {
            assert!(LabelSelector::parse(s).unwrap().matches(&o), "{s}");
        }
        let no = [
            "env in (dev,qa)",
            "env notin (prod)",
            "missing in (x)",
            "!env",
        ];
        for s in no {
            assert!(!LabelSelector::parse(s).unwrap().matches(&o), "{s}");
        }
        assert!(LabelSelector::parse("env in prod").is_err());
    }

    #[test]
    fn field_selectors_read_dotted_paths() {
        let o = obj(json!({}));
        assert!(
            FieldSelector::parse("spec.nodeName=n1")
                .unwrap()
                .matches(&o)
        );
        assert!(
            !FieldSelector::parse("spec.nodeName!=n1")
                .unwrap()
                .matches(&o)
        );
        assert!(
            FieldSelector::parse("status.phase!=Running")
                .unwrap()
                .matches(&o)
        );
    }
}
