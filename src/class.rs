//! Priority classes: the operator's ordered class names, and which class a request belongs to.
//!
//! A class is carried as its rank in `[classes] order` (0 is the most urgent), so that the
//! pacer and the stores compare small integers and never names. Without a `[classes]` section
//! there is one class, `default`, and every request belongs to it.

use std::time::Duration;

use http::{HeaderName, HeaderValue};
use serde::Serialize;

/// The request header that names a class. Removed before forwarding.
pub const CLASS_HEADER: HeaderName = HeaderName::from_static("pacegate-class");

/// A class, as its rank: 0 is the most urgent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Class(pub u16);

/// The validated `[classes]` section.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Classes {
    /// Class names, most urgent first.
    pub order: Vec<String>,
    /// The class of a request that names none.
    pub default: String,
    /// Guaranteed fractions of the slots while the class has waiters, by name.
    pub share: std::collections::BTreeMap<String, f64>,
    /// `max_wait` overrides, by name.
    #[serde(with = "crate::class::durations")]
    pub max_wait: std::collections::BTreeMap<String, Duration>,
    /// Whether the config has a `[classes]` section: only then does a proxy user name that
    /// names no class count as a mistake.
    #[serde(skip)]
    pub configured: bool,
}

/// A class name that `[classes] order` does not list.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown class `{name}` (from the {source_name}); the classes are: {known}")]
pub struct UnknownClass {
    /// The name asked for.
    pub name: String,
    /// Where it came from: the header or the proxy user name.
    pub source_name: &'static str,
    /// The configured names, comma-separated.
    pub known: String,
}

impl Default for Classes {
    fn default() -> Self {
        Self {
            order: vec!["default".into()],
            default: "default".into(),
            share: Default::default(),
            max_wait: Default::default(),
            configured: false,
        }
    }
}

impl Classes {
    /// Whether this is the one implicit class of a config without `[classes]`.
    pub fn is_implicit(&self) -> bool {
        !self.configured
    }

    /// The class named `name`.
    pub fn lookup(&self, name: &str) -> Option<Class> {
        self.order
            .iter()
            .position(|n| n == name)
            .and_then(|i| u16::try_from(i).ok())
            .map(Class)
    }

    /// The name of `class`.
    pub fn name(&self, class: Class) -> &str {
        self.order
            .get(usize::from(class.0))
            .map_or("default", String::as_str)
    }

    /// The class of a request that names none.
    pub fn default_class(&self) -> Class {
        self.lookup(&self.default).unwrap_or(Class(0))
    }

    /// How many classes there are.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// Always false: there is at least one class.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// Every class, most urgent first.
    pub fn all(&self) -> impl Iterator<Item = Class> + '_ {
        (0..self.order.len()).filter_map(|i| u16::try_from(i).ok().map(Class))
    }

    /// Each class's share by rank (0 for none).
    pub fn shares(&self) -> Vec<f64> {
        self.order
            .iter()
            .map(|n| self.share.get(n).copied().unwrap_or(0.0))
            .collect()
    }

    /// The `max_wait` override of `class`, if any.
    pub fn max_wait(&self, class: Class) -> Option<Duration> {
        self.max_wait.get(self.name(class)).copied()
    }

    /// The class a request asks for: its `Pacegate-Class` header (`asked`, where it has one),
    /// else the user name of its proxy credentials, else `fallback` (the default class, or
    /// the class of the CONNECT an intercepted request came through). `authenticated` says
    /// whether proxy authentication is on: then the user name is an identity first, and only
    /// a class when it names one.
    pub fn of_request(
        &self,
        asked: Option<&HeaderValue>,
        user: Option<&str>,
        authenticated: bool,
        fallback: Class,
    ) -> Result<Class, UnknownClass> {
        let unknown = |name: &str, source_name| UnknownClass {
            name: name.to_owned(),
            source_name,
            known: self.order.join(", "),
        };
        if let Some(value) = asked {
            let name = value.to_str().unwrap_or("(not text)").trim();
            return self
                .lookup(name)
                .ok_or_else(|| unknown(name, "Pacegate-Class header"));
        }
        match user.filter(|u| !u.is_empty()) {
            Some(name) => match self.lookup(name) {
                Some(class) => Ok(class),
                None if authenticated || !self.configured => Ok(fallback),
                None => Err(unknown(name, "proxy user name")),
            },
            None => Ok(fallback),
        }
    }
}

pub(crate) mod durations {
    //! Serialises a map of durations as humantime strings.
    use std::collections::BTreeMap;
    use std::time::Duration;

    pub(crate) fn serialize<S: serde::Serializer>(
        map: &BTreeMap<String, Duration>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut out = s.serialize_map(Some(map.len()))?;
        for (k, v) in map {
            out.serialize_entry(k, &humantime::format_duration(*v).to_string())?;
        }
        out.end()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn classes() -> Classes {
        Classes {
            order: vec!["interactive".into(), "scheduled".into(), "backfill".into()],
            default: "scheduled".into(),
            share: [("backfill".to_owned(), 0.1)].into(),
            max_wait: Default::default(),
            configured: true,
        }
    }

    fn header(v: &str) -> Option<HeaderValue> {
        Some(v.parse().unwrap())
    }

    #[test]
    fn ranks_follow_the_order() {
        let c = classes();
        assert_eq!(c.lookup("interactive"), Some(Class(0)));
        assert_eq!(c.lookup("backfill"), Some(Class(2)));
        assert_eq!(c.default_class(), Class(1));
        assert_eq!(c.name(Class(2)), "backfill");
        assert_eq!(c.shares(), vec![0.0, 0.0, 0.1]);
    }

    #[test]
    fn the_header_wins_over_the_user_name() {
        let c = classes();
        let d = c.default_class();
        assert_eq!(
            c.of_request(header("interactive").as_ref(), Some("backfill"), false, d),
            Ok(Class(0))
        );
        assert_eq!(c.of_request(None, Some("backfill"), false, d), Ok(Class(2)));
        assert_eq!(c.of_request(None, None, false, d), Ok(d));
        assert_eq!(c.of_request(None, None, false, Class(0)), Ok(Class(0)));
    }

    #[test]
    fn an_unknown_class_is_an_error_never_a_default() {
        let c = classes();
        let d = c.default_class();
        let err = c
            .of_request(header("urgent").as_ref(), None, false, d)
            .unwrap_err();
        assert!(err.to_string().contains("urgent"), "{err}");
        assert!(err.to_string().contains("interactive, scheduled, backfill"));
        let err = c.of_request(None, Some("bakfill"), false, d).unwrap_err();
        assert!(err.to_string().contains("proxy user name"), "{err}");
        // With authentication on, the user name is an identity; it picks a class only when it
        // names one.
        assert_eq!(c.of_request(None, Some("worker"), true, d), Ok(d));
        // Without a [classes] section, user names are not classes at all.
        assert_eq!(
            Classes::default().of_request(None, Some("worker"), false, Class(0)),
            Ok(Class(0))
        );
    }
}
