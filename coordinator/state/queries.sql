-- All SQL of the state package, as named blocks: "-- name: NAME" starts one. The SQLite
-- store (sqlite.py) writes and reads through them; the read-only ProjectReader (reader.py)
-- that `tilehive logs`, `status` and the demo summary use reads through the ones below
-- "Read-only queries", and through a few of the store's.
--
-- The writes below take a record's fields in order as numbered parameters (?1 is the first
-- field): queries.py's WRITES names the record of each, and a test holds every column to
-- its field.

-- name: upsert_gemm
INSERT INTO gemms (id, step, label, m, n, k, trans_a, trans_b, tile, a_id, b_id, policy, state,
                   error, created)
VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15)
ON CONFLICT(id) DO UPDATE SET state = excluded.state, error = excluded.error;

-- name: upsert_host
INSERT INTO hosts (id, name, token_hash, created, last_contact, gflops, threads, max_memory_mb,
                   consecutive_valid, valid_count, invalid_count, error_count, max_in_progress,
                   quarantined, gone)
VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15)
ON CONFLICT(id) DO UPDATE SET
    name = excluded.name, last_contact = excluded.last_contact, gflops = excluded.gflops,
    threads = excluded.threads, max_memory_mb = excluded.max_memory_mb,
    consecutive_valid = excluded.consecutive_valid, valid_count = excluded.valid_count,
    invalid_count = excluded.invalid_count, error_count = excluded.error_count,
    max_in_progress = excluded.max_in_progress, quarantined = excluded.quarantined,
    gone = excluded.gone;

-- name: upsert_workunit
INSERT INTO workunits (id, gemm_id, step, i0, i1, j0, j1, k, a_panel, b_panel, trans_a,
                       trans_b, kernel_version, policy, target_nresults, min_quorum,
                       max_error_results, max_total_results, delay_bound, state,
                       canonical_result, canonical_hash, error_mask, transition_time,
                       accelerated, created)
VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19,
        ?20, ?21, ?22, ?23, ?24, ?25, ?26)
ON CONFLICT(id) DO UPDATE SET
    target_nresults = excluded.target_nresults, min_quorum = excluded.min_quorum,
    state = excluded.state,
    canonical_result = excluded.canonical_result, canonical_hash = excluded.canonical_hash,
    error_mask = excluded.error_mask, transition_time = excluded.transition_time,
    accelerated = excluded.accelerated;

-- name: upsert_result
-- A result's host is written with its first row (its assignment; one that ends unsent has
-- none) and never changes: a result is one assignment to one host. Left out of the update,
-- it spares the results_host index a rewrite on every later row (a tenth of a commit's time).
INSERT INTO results (id, wu_id, host_id, server_state, outcome, validate_state, upload_tile,
                     sent_time, received_time, report_deadline, output_hash, has_tile, error)
VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)
ON CONFLICT(id) DO UPDATE SET
    server_state = excluded.server_state,
    outcome = excluded.outcome, validate_state = excluded.validate_state,
    upload_tile = excluded.upload_tile, sent_time = excluded.sent_time,
    received_time = excluded.received_time, report_deadline = excluded.report_deadline,
    output_hash = excluded.output_hash, has_tile = excluded.has_tile, error = excluded.error;

-- name: insert_event
-- ?10 is the event's id: the store numbers events, so it is not inserted.
INSERT INTO events (time, kind, state, message, step, gemm_id, wu_id, result_id, host_id, data)
VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?11);

-- name: insert_reply
INSERT OR REPLACE INTO work_replies (host_id, request_id, time, body)
VALUES (?1, ?2, ?3, ?4);

-- name: prune_replies
-- Older than :before, or past each host's :keep newest.
DELETE FROM work_replies
WHERE time < :before
   OR rowid IN (
       SELECT rowid FROM (
           SELECT rowid, row_number() OVER (PARTITION BY host_id ORDER BY time DESC) AS age
           FROM work_replies
       ) WHERE age > :keep
   );

-- name: count_replies
SELECT count(*) AS n FROM work_replies;

-- name: select_reply
SELECT body FROM work_replies WHERE host_id = :host_id AND request_id = :request_id;

-- name: select_hosts
SELECT * FROM hosts;

-- name: select_result
SELECT * FROM results WHERE id = :id;

-- name: select_gemm
SELECT * FROM gemms WHERE id = :id;

-- name: select_last_gemm_step
SELECT COALESCE(MAX(step), -1) AS step FROM gemms;

-- name: select_active_gemms
SELECT * FROM gemms WHERE state = 'active';

-- name: select_workunits_of_gemm
SELECT * FROM workunits WHERE gemm_id = :gemm_id;

-- name: select_results_of_gemm
SELECT results.* FROM results JOIN workunits ON results.wu_id = workunits.id
WHERE workunits.gemm_id = :gemm_id;

-- name: select_events
SELECT * FROM events
WHERE id > :after
  AND (:kind IS NULL OR kind = :kind)
  AND (:step IS NULL OR step = :step)
  AND (:state IS NULL OR state = :state)
  AND (:host_id IS NULL OR host_id = :host_id)
ORDER BY id LIMIT :limit;

-- name: count_workunits_by_state
-- An error whose product was dropped (WuError.CANCELLED, 16) counts as cancelled
-- (records.counted_state).
SELECT state, SUM(n) AS n FROM (
    SELECT CASE WHEN state = 'error' AND error_mask & 16 THEN 'cancelled' ELSE state END
        AS state, COUNT(*) AS n
    FROM workunits GROUP BY 1
    UNION ALL SELECT what AS state, n FROM purged WHERE what != 'invalid_results'
) GROUP BY state;

-- name: select_blobs_through_step
-- Of the products that ended (done, or failed: a failed one is never run again by id).
SELECT a_panel AS blob FROM workunits JOIN gemms ON workunits.gemm_id = gemms.id
WHERE gemms.step <= :step AND gemms.state IN ('done', 'failed')
UNION SELECT b_panel FROM workunits JOIN gemms ON workunits.gemm_id = gemms.id
WHERE gemms.step <= :step AND gemms.state IN ('done', 'failed')
UNION SELECT results.output_hash FROM results
JOIN workunits ON results.wu_id = workunits.id JOIN gemms ON workunits.gemm_id = gemms.id
WHERE gemms.step <= :step AND gemms.state IN ('done', 'failed') AND results.has_tile = 1;

-- name: select_blobs_after_step
-- Of the products that may still read them: later steps', and any still active.
SELECT a_panel AS blob FROM workunits JOIN gemms ON workunits.gemm_id = gemms.id
WHERE gemms.step > :step OR gemms.state = 'active'
UNION SELECT b_panel FROM workunits JOIN gemms ON workunits.gemm_id = gemms.id
WHERE gemms.step > :step OR gemms.state = 'active'
UNION SELECT results.output_hash FROM results
JOIN workunits ON results.wu_id = workunits.id JOIN gemms ON workunits.gemm_id = gemms.id
WHERE (gemms.step > :step OR gemms.state = 'active') AND results.has_tile = 1;

-- name: mark_gemms_pruned
UPDATE gemms SET state = 'pruned' WHERE step <= :step AND state = 'done';

-- name: select_recent_events
SELECT * FROM events WHERE kind = :kind AND state = :state ORDER BY id DESC LIMIT :limit;

-- name: count_invalid_results
SELECT (SELECT COUNT(*) FROM results WHERE validate_state = 'invalid')
     + COALESCE((SELECT n FROM purged WHERE what = 'invalid_results'), 0) AS n;

-- Read-only queries: reader.py, for `tilehive logs`, `tilehive status` and the demo summary.

-- name: count_tables
-- 0: a coordinator has made the file but not yet its tables (or was killed in between).
SELECT COUNT(*) AS n FROM sqlite_master WHERE type = 'table';

-- name: select_oldest_step
-- The steps before it were purged by a checkpoint (archived under DIR/logs), or never ran.
SELECT MIN(step) AS n FROM workunits;

-- name: select_host_ids_named
SELECT id FROM hosts WHERE name = :name ORDER BY id;

-- name: select_host_registered
SELECT EXISTS (SELECT 1 FROM hosts WHERE id = :id) AS registered;

-- name: select_workunits_for_log
-- :state is a state as status counts it (records.counted_state: an error whose product was
-- dropped, WuError.CANCELLED = 16, is 'cancelled'), or 'failed': error or cancelled.
SELECT w.*, g.label, g.error AS gemm_error FROM workunits w JOIN gemms g ON g.id = w.gemm_id
WHERE (:step IS NULL OR w.step = :step)
  AND (:state IS NULL
       OR (CASE WHEN w.state = 'error' AND w.error_mask & 16 THEN 'cancelled' ELSE w.state END)
          = :state
       OR (:state = 'failed' AND w.state = 'error'))
  AND (:since IS NULL OR w.created >= :since)
  AND (:host_id IS NULL OR w.id IN (SELECT wu_id FROM results WHERE host_id = :host_id))
ORDER BY w.created DESC, w.i0 DESC, w.j0 DESC LIMIT :limit;

-- name: select_results_of_workunits
SELECT * FROM results WHERE wu_id IN (SELECT value FROM json_each(:wu_ids));

-- name: select_events_of_kinds
SELECT * FROM events
WHERE id > :after
  AND kind IN (SELECT value FROM json_each(:kinds))
  AND (:step IS NULL OR step = :step)
  AND (:state IS NULL OR state = :state)
  AND (:host_id IS NULL OR host_id = :host_id)
  AND (:since IS NULL OR time >= :since)
ORDER BY id LIMIT :limit;

-- name: select_last_event_id
SELECT COALESCE(MAX(id), 0) AS n FROM events;

-- name: count_results_by_server_state
SELECT server_state, COUNT(*) AS n FROM results GROUP BY server_state;

-- name: count_events_since
SELECT COUNT(*) AS n FROM events WHERE kind = :kind AND state = :state AND time >= :since;

-- name: count_results_by_verdict
SELECT CASE WHEN outcome IN ('didnt_need', 'aborted') THEN 'not needed'
            WHEN outcome IN ('client_error', 'no_reply') THEN 'failed'
            WHEN validate_state = 'init' THEN 'pending'
            ELSE validate_state END AS verdict,
       COUNT(*) AS n
FROM results GROUP BY 1;

-- name: select_host_totals
SELECT name, valid_count, invalid_count, error_count FROM hosts ORDER BY id;

-- name: count_products
SELECT (SELECT COUNT(*) FROM gemms) AS gemms, (SELECT COUNT(*) FROM workunits) AS workunits;

-- name: select_newest_events_of_kinds
SELECT * FROM events
WHERE kind IN (SELECT value FROM json_each(:kinds))
  AND (:step IS NULL OR step = :step)
  AND (:state IS NULL OR state IN (SELECT value FROM json_each(:state)))
  AND (:host_id IS NULL OR host_id = :host_id)
  AND (:since IS NULL OR time >= :since)
ORDER BY id DESC LIMIT :limit;

-- name: count_events_of_kinds
SELECT COUNT(*) AS n FROM events
WHERE kind IN (SELECT value FROM json_each(:kinds))
  AND (:step IS NULL OR step = :step)
  AND (:state IS NULL OR state IN (SELECT value FROM json_each(:state)))
  AND (:host_id IS NULL OR host_id = :host_id)
  AND (:since IS NULL OR time >= :since);

-- name: count_workunits_for_log
-- :state as in select_workunits_for_log.
SELECT COUNT(*) AS n FROM workunits w
WHERE (:step IS NULL OR w.step = :step)
  AND (:state IS NULL
       OR (CASE WHEN w.state = 'error' AND w.error_mask & 16 THEN 'cancelled' ELSE w.state END)
          = :state
       OR (:state = 'failed' AND w.state = 'error'))
  AND (:since IS NULL OR w.created >= :since)
  AND (:host_id IS NULL OR w.id IN (SELECT wu_id FROM results WHERE host_id = :host_id));

-- name: select_host_pauses_since
SELECT host_id, state FROM events
WHERE kind = 'host' AND state IN ('paused', 'resumed', 'left') AND time >= :since
ORDER BY id;

-- name: select_last_event_in_states
SELECT * FROM events
WHERE kind = :kind AND state IN (SELECT value FROM json_each(:states))
ORDER BY id DESC LIMIT 1;

-- name: select_events_through_step
SELECT * FROM events WHERE step <= :step AND time < :before ORDER BY id;

-- name: select_panel_steps
SELECT panel, MAX(step) AS step FROM (
    SELECT a_panel AS panel, step FROM workunits
    UNION ALL
    SELECT b_panel AS panel, step FROM workunits
) GROUP BY panel;

-- name: select_workunits_through_step
SELECT * FROM workunits WHERE step <= :step ORDER BY step, gemm_id, i0, j0;

-- name: add_purged_workunits
INSERT INTO purged (what, n)
SELECT CASE WHEN state = 'error' AND error_mask & 16 THEN 'cancelled' ELSE state END,
    COUNT(*)
FROM workunits WHERE step <= :step GROUP BY 1
ON CONFLICT(what) DO UPDATE SET n = n + excluded.n;

-- name: add_purged_invalid
INSERT INTO purged (what, n)
SELECT 'invalid_results', COUNT(*) FROM results JOIN workunits ON results.wu_id = workunits.id
WHERE workunits.step <= :step AND results.validate_state = 'invalid'
ON CONFLICT(what) DO UPDATE SET n = n + excluded.n;

-- name: delete_results_through_step
DELETE FROM results WHERE wu_id IN (SELECT id FROM workunits WHERE step <= :step);

-- name: delete_workunits_through_step
DELETE FROM workunits WHERE step <= :step;

-- name: delete_gemms_through_step
DELETE FROM gemms WHERE step <= :step;

-- name: delete_events_through_step
DELETE FROM events WHERE step <= :step AND time < :before;
