//! How the store's statements reach the database, by `[store] statements`:
//!
//! - `prepared` (the default): each statement is prepared once per pooled connection and then
//!   only bound and executed, so the database parses and plans it once.
//! - `unnamed`: each is sent unnamed, in one round trip that carries its parameters' types
//!   (Parse, Bind, Execute, Sync together). Nothing is prepared under a name and nothing is
//!   left in the session, so a pooler in transaction mode (PgBouncer's usual setting), which
//!   may run each statement on another server connection, runs every one of them; a named
//!   statement would be prepared on one server connection and executed on another
//!   ("prepared statement "s2" does not exist"). The database parses and plans each anew.
//!
//! A parameter's Postgres type follows from its Rust type ([`Param`]), so a call site lists
//! its values once for both ways and cannot name a type that does not fit them.

use std::time::SystemTime;

use deadpool_postgres::Object;
use tokio::time::Instant;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::Row;

use super::rows::db;
use crate::budget::StoreError;
use crate::config::Statements;

/// A statement parameter whose Postgres type follows from its Rust type.
pub(super) trait Param: ToSql + Sync {
    /// The type sent with the value.
    fn pg_type(&self) -> Type;
    /// The value, to encode.
    fn as_sql(&self) -> &(dyn ToSql + Sync);
}

/// The Rust types the store's statements bind, with their Postgres types.
trait Typed {
    const TYPE: Type;
}

impl<T: Typed + ToSql + Sync> Param for T {
    fn pg_type(&self) -> Type {
        T::TYPE
    }

    fn as_sql(&self) -> &(dyn ToSql + Sync) {
        self
    }
}

macro_rules! typed {
    ($($rust:ty => $pg:ident),* $(,)?) => {
        $(impl Typed for $rust {
            const TYPE: Type = Type::$pg;
        })*
    };
}

typed! {
    bool => BOOL,
    i32 => INT4,
    i64 => INT8,
    f64 => FLOAT8,
    String => TEXT,
    SystemTime => TIMESTAMPTZ,
    Vec<i32> => INT4_ARRAY,
    Vec<i64> => INT8_ARRAY,
    Vec<f64> => FLOAT8_ARRAY,
    Vec<Option<f64>> => FLOAT8_ARRAY,
}

impl Typed for &str {
    const TYPE: Type = Type::TEXT;
}

impl Typed for Vec<&str> {
    const TYPE: Type = Type::TEXT_ARRAY;
}

impl Typed for &[f64] {
    const TYPE: Type = Type::FLOAT8_ARRAY;
}

impl<T: Typed> Typed for Option<T> {
    const TYPE: Type = T::TYPE;
}

fn with_types<'a>(params: &'a [&'a dyn Param]) -> Vec<(&'a (dyn ToSql + Sync), Type)> {
    params.iter().map(|p| (p.as_sql(), p.pg_type())).collect()
}

fn values<'a>(params: &'a [&'a dyn Param]) -> Vec<&'a (dyn ToSql + Sync)> {
    params.iter().map(|p| p.as_sql()).collect()
}

/// What a statement that must return a row is refused with when it returned none.
pub(super) fn no_row(sql: &str) -> StoreError {
    StoreError::Refused(format!("postgres: no row from `{sql}`"))
}

/// A statement's row, if any, and when the statement was sent and answered.
pub(super) struct Timed {
    pub(super) row: Option<Row>,
    pub(super) sent: Instant,
    pub(super) arrived: Instant,
}

/// A pooled connection that sends statements as `[store] statements` says.
pub(super) struct Conn {
    client: Object,
    mode: Statements,
}

impl Conn {
    pub(super) fn new(client: Object, mode: Statements) -> Self {
        Self { client, mode }
    }

    /// Every row the statement returns, and when it was sent: after its preparing (where
    /// statements are prepared, once per connection; later calls find it cached).
    async fn send(
        &self,
        sql: &str,
        params: &[&dyn Param],
    ) -> Result<(Vec<Row>, Instant), StoreError> {
        let (rows, sent) = match self.mode {
            Statements::Prepared => {
                let statement = self.client.prepare_cached(sql).await.map_err(db)?;
                let sent = Instant::now();
                (self.client.query(&statement, &values(params)).await, sent)
            }
            Statements::Unnamed => {
                let sent = Instant::now();
                (
                    self.client.query_typed(sql, &with_types(params)).await,
                    sent,
                )
            }
        };
        Ok((rows.map_err(db)?, sent))
    }

    /// Every row the statement returns.
    pub(super) async fn rows(
        &self,
        sql: &str,
        params: &[&dyn Param],
    ) -> Result<Vec<Row>, StoreError> {
        Ok(self.send(sql, params).await?.0)
    }

    /// The row the statement returns, if any, timed from its sending (not its preparing) to
    /// its answer's arrival: what a reading of the database clock counts ([`super::clock`]).
    pub(super) async fn timed(
        &self,
        sql: &str,
        params: &[&dyn Param],
    ) -> Result<Timed, StoreError> {
        let (rows, sent) = self.send(sql, params).await?;
        Ok(Timed {
            row: rows.into_iter().next(),
            sent,
            arrived: Instant::now(),
        })
    }

    /// The row the statement returns, if any (each of the store's returns at most one).
    pub(super) async fn opt(
        &self,
        sql: &str,
        params: &[&dyn Param],
    ) -> Result<Option<Row>, StoreError> {
        Ok(self.rows(sql, params).await?.into_iter().next())
    }

    /// The row the statement returns; refused if it returns none.
    pub(super) async fn one(&self, sql: &str, params: &[&dyn Param]) -> Result<Row, StoreError> {
        self.opt(sql, params).await?.ok_or_else(|| no_row(sql))
    }
}

impl std::ops::Deref for Conn {
    type Target = Object;

    fn deref(&self) -> &Object {
        &self.client
    }
}

impl std::ops::DerefMut for Conn {
    fn deref_mut(&mut self) -> &mut Object {
        &mut self.client
    }
}
