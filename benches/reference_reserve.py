#!/usr/bin/env python3
"""The reference design, for comparison with pacegate's postgres store: one Python process
issuing the same single UPDATE (beat keeping on one row, returning the slot and the database
clock) over psycopg, with default durability.

    python3 benches/reference_reserve.py postgres://USER@HOST:PORT/DB [CALLS]

Prints p50/p95/p99 of one reservation in milliseconds. `cargo bench --bench store_postgres`
runs it on the same database, right after its own measurement.
"""
import statistics
import sys
import time

import psycopg

url = sys.argv[1]
calls = int(sys.argv[2]) if len(sys.argv) > 2 else 2000

with psycopg.connect(url, autocommit=True) as conn:
    conn.execute(
        """CREATE TABLE IF NOT EXISTS reference_budgets (
               destination text PRIMARY KEY,
               next_at timestamptz NOT NULL DEFAULT '-infinity')"""
    )
    conn.execute("INSERT INTO reference_budgets (destination) VALUES ('d') ON CONFLICT DO NOTHING")
    sql = """UPDATE reference_budgets AS b
             SET next_at = GREATEST(b.next_at, c.now) + interval '1 microsecond'
             FROM (SELECT clock_timestamp() AS now) AS c
             WHERE b.destination = 'd'
             RETURNING GREATEST(b.next_at - interval '1 microsecond', c.now), c.now"""
    for _ in range(100):
        conn.execute(sql).fetchone()
    samples = []
    for _ in range(calls):
        started = time.perf_counter()
        conn.execute(sql).fetchone()
        samples.append((time.perf_counter() - started) * 1000.0)
    samples.sort()
    q = lambda p: samples[min(len(samples) - 1, round((len(samples) - 1) * p))]
    print(f"reference (python, psycopg, single UPDATE): {calls} calls: p50 {q(0.5):.3f} ms, p95 {q(0.95):.3f} ms, p99 {q(0.99):.3f} ms")
