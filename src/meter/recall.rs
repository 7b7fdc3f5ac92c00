//! What a GraphQL query cost the last time it was sent: the estimate of the next request with
//! the same query text, where the vendor's points depend on the query and the client cannot
//! say them beforehand. A paginated query asks again and again with the same text and new
//! variables (a cursor), so the text alone is the query's name here; its variables are not.
//!
//! Held by each instance for its meters, in memory only: a restarted instance estimates a
//! query at the meter's `default` until it has seen it settled once.

use parking_lot::Mutex;
use std::borrow::Cow;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};

use serde::Deserialize;

/// The most query texts one generation holds: two generations are kept (see [`Recall`]).
const GENERATION: usize = 2048;

/// A GraphQL query's name for [`Recall`]: a hash of its text and operation name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Query(u64);

/// The fields of a GraphQL request body that name its query; everything else is skipped.
#[derive(Deserialize)]
struct Document<'a> {
    #[serde(borrow)]
    query: Cow<'a, str>,
    #[serde(borrow, default, rename = "operationName")]
    operation: Option<Cow<'a, str>>,
}

impl Query {
    /// The query `body` (a GraphQL request over JSON) asks, if it is one.
    pub fn of(body: &[u8]) -> Option<Self> {
        let doc: Document = serde_json::from_slice(body).ok()?;
        let mut hasher = std::hash::DefaultHasher::new();
        doc.query.hash(&mut hasher);
        doc.operation.hash(&mut hasher);
        Some(Self(hasher.finish()))
    }
}

/// The last settled cost of the queries a meter has seen lately, bounded: when the newer
/// generation is full it becomes the older one and the oldest is dropped, so that a query
/// asked often stays and one asked once goes within two generations.
#[derive(Debug, Default)]
pub struct Recall {
    generations: Mutex<Generations>,
}

#[derive(Debug, Default)]
struct Generations {
    newer: HashMap<Query, u64>,
    older: HashMap<Query, u64>,
}

impl Recall {
    /// What `query` cost when it was last settled, if it was lately.
    pub fn cost_of(&self, query: Query) -> Option<u64> {
        let mut g = self.generations.lock();
        if let Some(cost) = g.newer.get(&query) {
            return Some(*cost);
        }
        // Asked again: kept into the newer generation.
        let cost = g.older.remove(&query)?;
        g.insert(query, cost);
        Some(cost)
    }

    /// `query` cost `cost` this time.
    pub fn remember(&self, query: Query, cost: u64) {
        self.generations.lock().insert(query, cost);
    }
}

impl Generations {
    fn insert(&mut self, query: Query, cost: u64) {
        if self.newer.len() >= GENERATION && !self.newer.contains_key(&query) {
            self.older = std::mem::take(&mut self.newer);
        }
        self.older.remove(&query);
        self.newer.insert(query, cost);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(text: &str) -> Query {
        Query::of(serde_json::json!({ "query": text }).to_string().as_bytes()).unwrap()
    }

    #[test]
    fn a_query_is_named_by_its_text_and_operation_not_its_variables() {
        let page = |cursor: &str| {
            serde_json::json!({
                "query": "query($after: String) { repo { issues(first: 100, after: $after) { id } } }",
                "variables": { "after": cursor },
            })
            .to_string()
        };
        assert_eq!(
            Query::of(page("a").as_bytes()),
            Query::of(page("b").as_bytes())
        );
        let op = |name: &str| {
            serde_json::json!({ "query": "query A { a } query B { b }", "operationName": name })
                .to_string()
        };
        assert_ne!(Query::of(op("A").as_bytes()), Query::of(op("B").as_bytes()));
        assert_ne!(query("{ a }"), query("{ b }"));
        // Escapes in the text are read as the text they stand for.
        assert_eq!(
            Query::of(br#"{"query":"{ \u0061 }"}"#),
            Some(query("{ a }"))
        );
        for not_graphql in [&b""[..], b"[]", b"{\"model\":\"m\"}", b"{\"query\":3}"] {
            assert_eq!(Query::of(not_graphql), None);
        }
    }

    #[test]
    fn the_last_cost_is_recalled_and_the_memory_is_bounded() {
        let recall = Recall::default();
        let q = query("{ viewer { login } }");
        assert_eq!(recall.cost_of(q), None);
        recall.remember(q, 7);
        recall.remember(q, 5);
        assert_eq!(recall.cost_of(q), Some(5), "the last settlement counts");
        // A query asked often outlives many asked once; none outlives two generations unasked.
        let once = query("{ once }");
        recall.remember(once, 1);
        for i in 0..GENERATION * 3 {
            recall.remember(Query(i as u64), 1);
            if i % 100 == 0 {
                assert_eq!(recall.cost_of(q), Some(5));
            }
        }
        assert_eq!(recall.cost_of(once), None);
        let g = recall.generations.lock();
        assert!(g.newer.len() + g.older.len() <= 2 * GENERATION);
    }
}
