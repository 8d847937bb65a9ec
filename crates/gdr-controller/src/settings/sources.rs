//! Where configuration comes from and how the layers combine: built-in defaults < TOML
//! file (`--config`) < environment (the Go version's variable names) < `--set key=value`.

use std::fmt;
use std::path::PathBuf;

use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};

use super::SettingsError;
use super::keys::{KEYS, Key, Raw};

/// Where configuration comes from, besides the built-in defaults.
#[derive(Debug, Default, Clone)]
pub struct Sources {
    /// TOML file given with `--config`.
    pub file: Option<PathBuf>,
    /// `(key, value)` pairs from `--set key=value`, applied last.
    pub overrides: Vec<(String, String)>,
    /// Read the process environment (off in tests that must not see it).
    pub environment: bool,
}

impl Sources {
    /// Parses a `--set` value of the form `key=value`, rejecting unknown keys.
    pub fn parse_override(raw: &str) -> Result<(String, String), SettingsError> {
        let (key, value) = raw
            .split_once('=')
            .ok_or_else(|| SettingsError::Flag(raw.into(), "expected key=value".into()))?;
        let key = key.trim().to_ascii_lowercase();
        if !KEYS.iter().any(|k| k.name == key) {
            return Err(SettingsError::Flag(
                raw.into(),
                format!("unknown key {key:?}; see the configuration reference in --help"),
            ));
        }
        Ok((key, value.to_owned()))
    }

    /// A TOML file, nothing else (tests).
    pub fn file(path: impl Into<PathBuf>) -> Self {
        Sources {
            file: Some(path.into()),
            ..Sources::default()
        }
    }

    /// Only `--set`-style overrides, no file, no environment (tests).
    pub fn overrides<I, S>(pairs: I) -> Result<Self, SettingsError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        Ok(Sources {
            overrides: pairs
                .into_iter()
                .map(|p| Sources::parse_override(p.as_ref()))
                .collect::<Result<_, _>>()?,
            ..Sources::default()
        })
    }

    pub(crate) fn load(&self) -> Result<Raw, SettingsError> {
        let mut figment = Figment::from(Serialized::defaults(Raw::default()));
        if let Some(file) = &self.file {
            if !file.is_file() {
                return Err(SettingsError::MissingFile(file.clone()));
            }
            figment = figment.merge(Toml::file_exact(file));
        }
        if self.environment {
            check_environment_is_text()?;
            let names: Vec<String> = KEYS.iter().map(Key::env).collect();
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            // Empty variables count as unset, as in the Go version's env().
            figment = figment.merge(
                Env::raw()
                    .only(&names)
                    .filter_map(|k| {
                        let set = std::env::var(k.as_str()).is_ok_and(|v| !v.trim().is_empty());
                        set.then(|| k.as_str().to_ascii_lowercase().into())
                    })
                    .lowercase(true),
            );
        }
        for (key, value) in &self.overrides {
            // Parsed like environment values, so `--set pod_capacity=3` is a number.
            let parsed: figment::value::Value = match value.parse() {
                Ok(v) => v,
                Err(never) => match never {},
            };
            figment = figment.merge(Serialized::global(key.as_str(), parsed));
        }
        figment
            .extract::<Raw>()
            .map_err(|e| SettingsError::Parse(ParseError(Box::new(e))))
    }
}

/// figment skips variables whose value is not UTF-8, which would turn a set variable into
/// "required but missing"; name it instead.
fn check_environment_is_text() -> Result<(), SettingsError> {
    for key in KEYS {
        if let Some(value) = std::env::var_os(key.env())
            && value.to_str().is_none()
        {
            return Err(SettingsError::NotUtf8 { name: key.env() });
        }
    }
    Ok(())
}

/// A value of the wrong shape, as figment reports it (key, source, what was expected).
#[derive(Debug)]
pub struct ParseError(pub Box<figment::Error>);

impl fmt::Display for ParseError {
    /// figment names the key and its source (file path or variable); the environment
    /// variable is named too, so either spelling leads the operator to the setting.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        for e in (*self.0).clone() {
            if !first {
                writeln!(f)?;
            }
            first = false;
            let key = e.path.join(".");
            if key.is_empty() {
                write!(f, "{e}")?;
            } else {
                write!(f, "{key} ({}): {e}", key.to_ascii_uppercase())?;
            }
        }
        Ok(())
    }
}

impl std::error::Error for ParseError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.0)
    }
}
