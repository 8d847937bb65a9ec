//! The value types of configuration keys as they are written (TOML, environment, `--set`):
//! durations, lists, tables and the component list.

use std::collections::BTreeSet;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A duration written as `90s`, `5m`, `1h30m` or plain seconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Secs(pub Duration);

impl Secs {
    /// `seconds` seconds.
    pub const fn from_secs(seconds: u64) -> Self {
        Secs(Duration::from_secs(seconds))
    }
}

impl Serialize for Secs {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&humantime_serde::re::humantime::format_duration(self.0).to_string())
    }
}

impl<'de> Deserialize<'de> for Secs {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Secs(u64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Secs(s) => Ok(Secs::from_secs(s)),
            Raw::Text(t) => match t.trim().parse::<u64>() {
                Ok(s) => Ok(Secs::from_secs(s)),
                Err(_) => humantime_serde::re::humantime::parse_duration(t.trim())
                    .map(Secs)
                    .map_err(|e| {
                        serde::de::Error::custom(format!(
                            "{t:?} is not a duration like 30s or 5m: {e}"
                        ))
                    }),
            },
        }
    }
}

/// A list given as a TOML array or as a comma-separated string (environment, `--set`);
/// items are trimmed and empty ones dropped.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct List(pub Vec<String>);

impl List {
    /// A list of `items`.
    pub fn of(items: &[&str]) -> Self {
        List(items.iter().map(|s| (*s).to_owned()).collect())
    }

    /// The items as paths.
    pub fn paths(&self) -> Vec<PathBuf> {
        self.0.iter().map(PathBuf::from).collect()
    }
}

impl Serialize for List {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

impl<'de> Deserialize<'de> for List {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            One(String),
            Many(Vec<String>),
        }
        let items = match Raw::deserialize(d)? {
            Raw::One(s) => s.split(',').map(str::to_owned).collect::<Vec<_>>(),
            Raw::Many(v) => v,
        };
        Ok(List(
            items
                .into_iter()
                .map(|s| s.trim().to_owned())
                .filter(|s| !s.is_empty())
                .collect(),
        ))
    }
}

/// A table (`[key]` or `[key.<name>]` in TOML; `{name = value, …}` in the environment or
/// `--set`, figment's dictionary syntax). Its shape is checked when the settings are
/// converted, so errors name the entry (`pod_profiles.large: …`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Table(pub serde_json::Map<String, serde_json::Value>);

/// A controller component.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Component {
    /// FetchTask pollers, heartbeats, the JetStream producer and the RunnerService facade.
    Scheduler,
    /// Consumes pod assignments and runs their executors.
    PodWorker,
    /// Consumes vm assignments and runs their executors.
    VmWorker,
}

impl Component {
    /// Every component.
    pub const ALL: [Component; 3] = [
        Component::Scheduler,
        Component::PodWorker,
        Component::VmWorker,
    ];

    /// The name used in `COMPONENTS`.
    pub fn as_str(self) -> &'static str {
        match self {
            Component::Scheduler => "scheduler",
            Component::PodWorker => "pod-worker",
            Component::VmWorker => "vm-worker",
        }
    }
}

impl fmt::Display for Component {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The components this process runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Components(pub BTreeSet<Component>);

impl Components {
    /// Every component.
    pub fn all() -> Self {
        Components(Component::ALL.into_iter().collect())
    }

    /// Whether `component` runs here.
    pub fn contains(&self, component: Component) -> bool {
        self.0.contains(&component)
    }
}

impl Serialize for Components {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let names: Vec<&str> = self.0.iter().map(|c| c.as_str()).collect();
        s.serialize_str(&names.join(","))
    }
}

impl<'de> Deserialize<'de> for Components {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let List(names) = List::deserialize(d)?;
        if names.len() == 1 && names[0] == "all" {
            return Ok(Components::all());
        }
        names
            .iter()
            .map(|n| {
                Component::ALL
                    .into_iter()
                    .find(|c| c.as_str() == n)
                    .ok_or_else(|| {
                        let known: Vec<&str> = Component::ALL.iter().map(|c| c.as_str()).collect();
                        serde::de::Error::custom(format!(
                            "unknown component {n:?}; expected {} or all",
                            known.join(", ")
                        ))
                    })
            })
            .collect::<Result<_, _>>()
            .map(Components)
    }
}
