-- Every statement the package runs outside the ORM, each under its name.
--
-- Read and parsed once by store/sql.py, which runs them: no other module
-- holds a statement's text, nor a cursor. Each block begins with a line
--
--     -- name: <name>                  for PostgreSQL and SQLite alike
--     -- name: <name> [postgresql]     for one database only
--     -- name: <name> [sqlite]
--
-- and runs to the next. Its comment lines are the block's documentation;
-- what the store's modules say of each is said there, at the function
-- that runs it.
--
-- In a block:
--
--   %(name)s   a parameter, passed by name (any number of times);
--   %(**name)s rows of parameters, a list of tuples of one length, written
--              (%s, %s, …), (%s, %s, …) as many as are given;
--   %(~name)s  a parameter, a list of any length matched with "= ANY" (a
--              retraction's inboxes): the statement is planned for the
--              values bound at each run, never prepared. Only such a plan
--              hashes the list; a prepared statement's generic plan
--              compares each row with each element (a Delete to 10,000
--              inboxes: 2.3 s, 0.4 s planned each time), and a list as a
--              subquery is hashed only while it fits in work_mem (past
--              150,000 inboxes, each row with each again);
--   %(name)d   an integer written into the text (a PRAGMA takes no
--              parameters), checked to be one;
--   {name}     filled in once, when the statements are read: a table, as
--              the models name it and quoted ({delivery}, {batch}, {host},
--              {history}, {breaker}); {pending}, the pending status as a
--              literal; {channel}, what a send notifies and a listener
--              listens on; {batch_columns} and {batch_values}, a batch's
--              columns and their parameters, read off the model; or any
--              other block, for the same database.
--
-- Lists of rows are one JSON parameter (a list of lists), read by
-- jsonb_array_elements on PostgreSQL and json_each on SQLite, and lists of
-- ids a PostgreSQL array or an SQLite JSON list: the same text whatever
-- their length, prepared once, with one value to bind. Every status that
-- the partial indexes name is written out ({pending}), not bound, so that
-- the index is the statement's to use whatever is bound.
--
-- A delivery is pending exactly while its settled_at is NULL (every way out
-- of the queue sets it, a requeue clears it). Statements that find rows by
-- another index (their batch, the one they wait on) say "settled_at IS
-- NULL", not "status = pending": given the latter, a planner whose
-- statistics say the pending rows are few scans the due index, all of it,
-- as the backlog grows.


-- The claim --------------------------------------------------------------

-- name: claim [postgresql]
-- Every lane's share in one statement: each lane's candidates locked
-- (passing those another process holds), in the room the lanes before it
-- leave of the budget, then the first %(cap)s to each host among them
-- taken, lane by lane. The rows taken are looked up by id: as a join, the
-- planner may hash its guess of their number against a scan of the table.
-- Each lane's order is its index's (due_at, then where the row is).
WITH lane0 AS (
    SELECT id, host, due_at, 0 AS rank FROM {delivery}
    WHERE status = {pending} AND lane = %(lane0)s AND due_at <= %(now)s AND {claimable_host}
    ORDER BY due_at LIMIT GREATEST(0, %(budget)s)
    FOR UPDATE SKIP LOCKED
), lane1 AS (
    SELECT id, host, due_at, 1 AS rank FROM {delivery}
    WHERE status = {pending} AND lane = %(lane1)s AND due_at <= %(now)s AND {claimable_host}
    ORDER BY due_at LIMIT GREATEST(0, %(budget)s - (SELECT COUNT(*) FROM lane0))
    FOR UPDATE SKIP LOCKED
), lane2 AS (
    SELECT id, host, due_at, 2 AS rank FROM {delivery}
    WHERE status = {pending} AND lane = %(lane2)s AND due_at <= %(now)s AND {claimable_host}
    ORDER BY due_at
    LIMIT GREATEST(0, %(budget)s - (SELECT COUNT(*) FROM lane0) - (SELECT COUNT(*) FROM lane1))
    FOR UPDATE SKIP LOCKED
), lane3 AS (
    SELECT id, host, due_at, 3 AS rank FROM {delivery}
    WHERE status = {pending} AND lane = %(lane3)s AND due_at <= %(now)s AND {claimable_host}
    ORDER BY due_at
    LIMIT GREATEST(0, %(budget)s - (SELECT COUNT(*) FROM lane0) - (SELECT COUNT(*) FROM lane1)
        - (SELECT COUNT(*) FROM lane2))
    FOR UPDATE SKIP LOCKED
)
UPDATE {delivery} SET due_at = %(until)s, lease_token = %(token)s
WHERE id = ANY(ARRAY(
    SELECT id FROM (
        SELECT id, rank, due_at,
            ROW_NUMBER() OVER (PARTITION BY host ORDER BY rank, due_at, id) AS turn
        FROM (
            SELECT * FROM lane0 UNION ALL SELECT * FROM lane1
            UNION ALL SELECT * FROM lane2 UNION ALL SELECT * FROM lane3
        ) AS candidates
    ) AS ranked
    WHERE turn <= %(cap)s ORDER BY rank, due_at, id LIMIT %(limit)s
))
RETURNING id, batch_id, inbox, host, attempts, via, destination, kind, last_status, lane

-- name: claimable_host [postgresql]
-- None to the hosts left out, and, when %(only)s names any, to those alone.
-- The hosts left out as a hashed subplan: thousands of them (as many
-- breakers open) cost a lookup a row read, where "= ANY" of a prepared
-- statement's array compares each row with each.
host NOT IN (SELECT unnest(%(excluded)s::varchar[]))
AND (%(only)s::varchar[] IS NULL OR host = ANY(%(only)s))

-- name: claimable_host [sqlite]
host NOT IN (SELECT value FROM json_each(%(excluded)s))
AND (%(only)s IS NULL OR host IN (SELECT value FROM json_each(%(only)s)))

-- name: claim_candidates [sqlite]
-- One lane's oldest due rows, as one JSON value: each row a statement
-- returns is an sqlite3 step of its own. The order is the index's, which
-- ends with the id.
SELECT json_group_array(json_array(id, host)) FROM (
    SELECT id, CASE WHEN typeof(host) = 'text' THEN host ELSE '' END AS host FROM {delivery}
    WHERE status = {pending} AND lane = %(lane)s AND due_at <= %(now)s AND {claimable_host}
    ORDER BY due_at, id LIMIT %(candidates)s
)

-- name: claimed_rows [sqlite]
-- A column SQLite keeps as something else than the text the package writes
-- (a BLOB, written by hand), which its JSON cannot hold, is read as '' (a
-- via as '?', no JSON): that row fails by itself (store/claims.py,
-- triage.py), and the rest of the claim is sent. The via is read as its
-- text, parsed by the claim: what is no JSON fails that row alone too.
SELECT json_group_array(json_array(
    id, batch_id,
    CASE WHEN typeof(inbox) = 'text' THEN inbox ELSE '' END,
    CASE WHEN typeof(host) = 'text' THEN host ELSE '' END,
    attempts,
    CASE WHEN via IS NULL OR typeof(via) = 'text' THEN via ELSE '?' END,
    CASE WHEN typeof(destination) = 'text' THEN destination ELSE '' END,
    CASE WHEN typeof(kind) = 'text' THEN kind ELSE '' END,
    CASE WHEN typeof(last_status) = 'integer' THEN last_status END,
    CASE WHEN typeof(lane) = 'text' THEN lane ELSE '' END
))
FROM {delivery} WHERE id IN (SELECT value FROM json_each(%(ids)s))

-- name: take [sqlite]
UPDATE {delivery} SET due_at = %(until)s, lease_token = %(token)s
WHERE id IN (SELECT value FROM json_each(%(ids)s))

-- name: lock_for_writing [sqlite]
-- A write that changes nothing: it takes the write lock, waiting as any
-- write does.
UPDATE {delivery} SET id = id WHERE 0

-- name: claimed_batches [postgresql]
SELECT id, sender, body, body_sha256, tag, deadline, max_attempts, synchronize_collection,
    ordering_key, event_type, lane, trace_context
FROM {batch} WHERE id = ANY(%(ids)s::bigint[])

-- name: claimed_batches [sqlite]
SELECT json_group_array(json_array(id, sender, body, body_sha256, tag, deadline, max_attempts,
    synchronize_collection, ordering_key, event_type, lane, trace_context))
FROM {batch} WHERE id IN (SELECT value FROM json_each(%(ids)s))

-- name: next_due
-- The earliest due time of each lane: one index read a lane.
SELECT
    (SELECT MIN(due_at) FROM {delivery} WHERE status = {pending} AND lane = %(lane0)s),
    (SELECT MIN(due_at) FROM {delivery} WHERE status = {pending} AND lane = %(lane1)s),
    (SELECT MIN(due_at) FROM {delivery} WHERE status = {pending} AND lane = %(lane2)s),
    (SELECT MIN(due_at) FROM {delivery} WHERE status = {pending} AND lane = %(lane3)s)

-- name: has_due
-- Whether any lane has a row that came due after %(since)s and by %(now)s.
SELECT
    EXISTS (SELECT 1 FROM {delivery} WHERE status = {pending} AND lane = %(lane0)s
        AND due_at <= %(now)s AND due_at > %(since)s)
    OR EXISTS (SELECT 1 FROM {delivery} WHERE status = {pending} AND lane = %(lane1)s
        AND due_at <= %(now)s AND due_at > %(since)s)
    OR EXISTS (SELECT 1 FROM {delivery} WHERE status = {pending} AND lane = %(lane2)s
        AND due_at <= %(now)s AND due_at > %(since)s)
    OR EXISTS (SELECT 1 FROM {delivery} WHERE status = {pending} AND lane = %(lane3)s
        AND due_at <= %(now)s AND due_at > %(since)s)


-- name: has_due_claimable
-- Whether any lane has a row due by %(now)s that a claim leaving out the
-- hosts %(excluded)s would take: an index read a lane, each due row's host
-- looked up in the hosts left out (a hashed subplan on PostgreSQL).
SELECT
    EXISTS (SELECT 1 FROM {delivery} WHERE status = {pending} AND lane = %(lane0)s
        AND due_at <= %(now)s AND {claimable_host})
    OR EXISTS (SELECT 1 FROM {delivery} WHERE status = {pending} AND lane = %(lane1)s
        AND due_at <= %(now)s AND {claimable_host})
    OR EXISTS (SELECT 1 FROM {delivery} WHERE status = {pending} AND lane = %(lane2)s
        AND due_at <= %(now)s AND {claimable_host})
    OR EXISTS (SELECT 1 FROM {delivery} WHERE status = {pending} AND lane = %(lane3)s
        AND due_at <= %(now)s AND {claimable_host})

-- name: claimable_due_hosts
-- The hosts of up to %(most)s rows due by %(now)s, in the lanes given, that
-- a claim leaving out the hosts %(excluded)s would take: after a claim
-- that took none of them, those another transaction holds.
SELECT DISTINCT host FROM (
    SELECT host FROM {delivery} WHERE status = {pending}
        AND lane IN (%(lane0)s, %(lane1)s, %(lane2)s, %(lane3)s)
        AND due_at <= %(now)s AND {claimable_host}
    LIMIT %(most)s
) AS due

-- A send ------------------------------------------------------------------

-- name: insert_batch
-- No row when a batch with its idempotency key is already kept: the send
-- then queues nothing (the index's own condition, word for word, so that
-- both databases match the conflict to it).
INSERT INTO {batch} ({batch_columns}) VALUES ({batch_values})
ON CONFLICT (idempotency_key) WHERE idempotency_key > '' DO NOTHING
RETURNING id

-- name: insert_batches [sqlite]
-- Several batches, a row each, and none where a batch with its idempotency
-- key is kept (as insert_batch). Each written is returned with its key,
-- which tells the rows apart: a database promises them in no order.
INSERT INTO {batch} ({batch_columns}) VALUES %(**batches)s
ON CONFLICT (idempotency_key) WHERE idempotency_key > '' DO NOTHING
RETURNING id, idempotency_key

-- name: insert_batches [postgresql]
-- The same, from one JSON list of objects (each a column's value by its
-- name): psycopg takes a moment to read each placeholder of a statement,
-- and 500 batches have 10,000. With the wake-up of every listening process
-- (sent once, at commit, however many rows notify).
WITH b AS (
    INSERT INTO {batch} ({batch_columns})
    SELECT {batch_columns} FROM json_populate_recordset(NULL::{batch}, %(batches)s::json)
    ON CONFLICT (idempotency_key) WHERE idempotency_key > '' DO NOTHING
    RETURNING id, idempotency_key
)
SELECT id, idempotency_key, pg_notify('{channel}', '') FROM b

-- name: insert_batches_deliveries [sqlite]
-- A chunk of several batches' deliveries, each row its batch's id first.
{deliveries_into} v.batch_id, {queued_values}
FROM (
    SELECT column1 AS batch_id, column2 AS inbox, column3 AS host, column4 AS destination,
        column5 AS via, column6 AS sequence, column7 AS after_id
    FROM (VALUES %(**rows)s)
) AS v

-- name: insert_batches_deliveries [postgresql]
-- The same, an array a column.
{deliveries_into} v.batch_id, {queued_values}
FROM unnest(%(batch_ids)s::bigint[], %(inboxes)s::varchar[], %(hosts)s::varchar[],
    %(destinations)s::varchar[], %(vias)s::jsonb[], %(sequences)s::varchar[],
    %(after_ids)s::bigint[])
    AS v(batch_id, inbox, host, destination, via, sequence, after_id)

-- name: insert_deliveries [sqlite]
-- A chunk of a batch's deliveries, a placeholder a value: SQLite reads
-- them faster than a JSON list's, and a chunk's are fewer than the most
-- parameters it takes (CHUNK × 6, and a few).
{deliveries_of} (SELECT %(batch_id)s AS id) AS b, ({queued_rows}) AS v

-- name: insert_deliveries [postgresql]
-- A chunk of a batch's deliveries, an array a column: one short statement
-- whatever the rows, which psycopg reads once, not a placeholder a value.
{deliveries_of} (SELECT %(batch_id)s::bigint AS id) AS b, {queued_rows}

-- name: insert_batch_and_deliveries [postgresql]
-- The batch, its first deliveries and the wake-up of every listening
-- process in one round trip. PostgreSQL delivers the notification when,
-- and only when, the transaction commits.
WITH b AS ({insert_batch}),
new_deliveries AS ({deliveries_of} b, {queued_rows})
SELECT id, pg_notify('{channel}', '') FROM b

-- name: insert_batch_and_delivery [postgresql]
-- The same, for a send to one inbox: its values bound one by one, which
-- psycopg does in a fraction of the time it takes to build six arrays.
WITH b AS ({insert_batch}),
new_delivery AS ({deliveries_of} b, {queued_row})
SELECT id, pg_notify('{channel}', '') FROM b

-- name: deliveries_of
-- What a queued delivery is written with, but where its batch (b) and its
-- rows (v) come from.
{deliveries_into} b.id, {queued_values}
FROM

-- name: deliveries_into
INSERT INTO {delivery} (batch_id, inbox, host, destination, via, sequence, after_id, kind, lane,
    status, attempts, due_at, last_error)
SELECT

-- name: queued_values
-- A queued delivery's values but its batch's id. One that waits on another
-- has no due time until that settles; one to a paused host, until the host
-- is resumed: the host table is read by the statement that writes, so that
-- a send costs no query of its own for it.
v.inbox, v.host, v.destination, v.via, v.sequence, v.after_id, %(kind)s, %(lane)s,
    {pending}, 0,
    CASE WHEN v.after_id IS NULL AND NOT EXISTS (
        SELECT 1 FROM {host} AS h WHERE h.name = v.host AND h.paused_at IS NOT NULL
    ) THEN %(due)s{as_timestamp} END,
    ''

-- name: queued_rows [sqlite]
-- A VALUES list's columns are column1, column2, …: named here.
SELECT column1 AS inbox, column2 AS host, column3 AS destination, column4 AS via,
    column5 AS sequence, column6 AS after_id
FROM (VALUES %(**rows)s)

-- name: queued_rows [postgresql]
unnest(%(inboxes)s::varchar[], %(hosts)s::varchar[], %(destinations)s::varchar[],
    %(vias)s::jsonb[], %(sequences)s::varchar[], %(after_ids)s::bigint[])
    AS v(inbox, host, destination, via, sequence, after_id)

-- name: queued_row [postgresql]
(VALUES (%(inbox)s::varchar, %(host)s::varchar, %(destination)s::varchar, %(via)s::jsonb,
    %(sequence)s::varchar, %(after_id)s::bigint))
    AS v(inbox, host, destination, via, sequence, after_id)

-- name: as_timestamp [postgresql]
::timestamptz

-- name: as_timestamp [sqlite]


-- Retractions ---------------------------------------------------------------

-- name: batches_about
-- A sender's batches still in the queue about the object %(about)s (a
-- Delete's); "object_id > ''" is the partial index's own condition, written
-- out so that both databases see the index is theirs to use.
SELECT id, tag FROM {batch}
WHERE object_id = %(about)s AND object_id > '' AND sender = %(sender)s
    AND finished_at IS NULL AND id <> %(batch)s
ORDER BY id

-- name: batches_of_activity
-- A sender's batches still in the queue of the activity %(about)s (an Undo's).
SELECT id, tag FROM {batch}
WHERE activity_id = %(about)s AND activity_id > '' AND sender = %(sender)s
    AND finished_at IS NULL AND id <> %(batch)s
ORDER BY id

-- name: retracted_pending_at [postgresql]
-- Which of the inboxes %(inboxes)s a delivery of %(batches)s is still
-- pending at, attempted or not.
SELECT DISTINCT inbox FROM {delivery}
WHERE batch_id = ANY(%(batches)s::bigint[]) AND settled_at IS NULL
    AND inbox = ANY(%(~inboxes)s::varchar[])

-- name: retracted_pending_at [sqlite]
SELECT DISTINCT inbox FROM {delivery}
WHERE batch_id IN (SELECT value FROM json_each(%(batches)s)) AND settled_at IS NULL
    AND inbox IN (SELECT value FROM json_each(%(inboxes)s))

-- name: retraction_inboxes
-- The inboxes the retraction's batch %(batch)s is queued to.
SELECT n.inbox FROM {delivery} AS n WHERE n.batch_id = %(batch)s

-- name: inboxes_of [postgresql]
-- The same, read, with the deliveries' ids: what the statements below take
-- on PostgreSQL.
SELECT n.id, n.inbox FROM {delivery} AS n WHERE n.batch_id = %(batch)s

-- name: lock_superseded [postgresql]
-- What supersede (or supersede_left_out) is about to change, locked first
-- lowest id first, as every writer of many rows locks them: its UPDATE
-- locks them in the order its plan reads them, which deadlocked with an
-- operator's give-up of the same rows.
SELECT id FROM {delivery}
WHERE batch_id = ANY(%(batches)s::bigint[]) AND settled_at IS NULL
    AND last_attempt_at IS NULL
    AND (lease_token IS NULL OR due_at <= %(now)s)
    AND inbox = ANY(%(~inboxes)s::varchar[])
ORDER BY id FOR UPDATE

-- name: supersede [postgresql]
-- The deliveries of %(batches)s to the retraction's inboxes (%(inboxes)s,
-- read first) that were never attempted (no request made: one held back
-- by its breaker, or by its lease, made none, however many tries it spent)
-- and are not held by a claim (a lapsed one aside): settled superseded,
-- unsent. What it returns is what it changed. The inboxes are a list
-- given, not a subquery: matched against a list, a row costs one lookup
-- whatever the planner believes of the table, where a join planned from
-- statistics taken while the table was small compared each of 10,000 rows
-- with 10,000 (seconds to minutes). One released to wait for the lease of
-- an attempt given up in flight keeps that time (lease_running), as a
-- give-up does, for what waits behind it (released_due).
UPDATE {delivery} SET status = %(superseded)s, due_at = {lease_running}, lease_token = NULL,
    settled_at = %(now)s, last_error = %(reason)s
WHERE batch_id = ANY(%(batches)s::bigint[]) AND settled_at IS NULL
    AND last_attempt_at IS NULL
    AND (lease_token IS NULL OR due_at <= %(now)s)
    AND inbox = ANY(%(~inboxes)s::varchar[])
RETURNING id, batch_id, inbox

-- name: supersede [sqlite]
UPDATE {delivery} SET status = %(superseded)s, due_at = {lease_running}, lease_token = NULL,
    settled_at = %(now)s, last_error = %(reason)s
WHERE batch_id IN (SELECT value FROM json_each(%(batches)s)) AND settled_at IS NULL
    AND last_attempt_at IS NULL
    AND (lease_token IS NULL OR due_at <= %(now)s)
    AND inbox IN ({retraction_inboxes})
RETURNING id, batch_id, inbox

-- name: supersede_left_out [postgresql]
-- The same at the inboxes %(inboxes)s the retraction was given but not
-- queued to, their host marked unavailable (a list, a JSON one on SQLite):
-- what was never attempted there is superseded all the same.
{supersede}

-- name: supersede_left_out [sqlite]
UPDATE {delivery} SET status = %(superseded)s, due_at = {lease_running}, lease_token = NULL,
    settled_at = %(now)s, last_error = %(reason)s
WHERE batch_id IN (SELECT value FROM json_each(%(batches)s)) AND settled_at IS NULL
    AND last_attempt_at IS NULL
    AND (lease_token IS NULL OR due_at <= %(now)s)
    AND inbox IN (SELECT value FROM json_each(%(inboxes)s))
RETURNING id, batch_id, inbox

-- name: retractions_since [postgresql]
-- For each of the batches %(batches)s, the later batches of its sender
-- that take it back: a Delete of its object, an Undo of it (found by the
-- partial index on object_id, its condition written out).
{deletes_since_of} AND b.id = ANY(%(batches)s::bigint[])
UNION ALL
{undos_since_of} AND b.id = ANY(%(batches)s::bigint[])

-- name: retractions_since [sqlite]
{deletes_since_of} AND b.id IN (SELECT value FROM json_each(%(batches)s))
UNION ALL
{undos_since_of} AND b.id IN (SELECT value FROM json_each(%(batches)s))

-- name: deletes_since_of
-- A retraction is taken back by an Undo of it alone: a later Delete of
-- the object it deletes too takes nothing of it back. A replay's copy of
-- a retraction is no retraction of its own: written after what followed
-- the first, it would take back what that had restored. The batches given
-- are read first, each one's retractions then looked up by an equal
-- object id, in two statements joined: SQLite, told one join with either
-- object id, read every batch about anything (CROSS JOIN keeps the order
-- written; PostgreSQL plans it as any join).
SELECT b.id, rb.id FROM {batch} AS b CROSS JOIN {batch} AS rb
WHERE rb.object_id = b.object_id AND b.object_id > '' AND rb.object_id > ''
    AND rb.retracts = 'object' AND b.retracts = ''
    AND rb.sender = b.sender AND rb.id > b.id
    AND NOT (rb.idempotency_key LIKE %(replay_key)s AND rb.tag LIKE %(replay_tag)s)

-- name: undos_since_of
SELECT b.id, rb.id FROM {batch} AS b CROSS JOIN {batch} AS rb
WHERE rb.object_id = b.activity_id AND b.activity_id > '' AND rb.object_id > ''
    AND rb.retracts = 'activity'
    AND rb.sender = b.sender AND rb.id > b.id
    AND NOT (rb.idempotency_key LIKE %(replay_key)s AND rb.tag LIKE %(replay_tag)s)

-- name: undone_retractions [postgresql]
-- Of the retractions %(ids)s, those a later Undo of their sender took back
-- (not a replay's copy of one).
{undone_retractions_of} WHERE r.id = ANY(%(ids)s::bigint[])

-- name: undone_retractions [sqlite]
{undone_retractions_of} WHERE r.id IN (SELECT value FROM json_each(%(ids)s))

-- name: undone_retractions_of
SELECT r.id FROM {batch} AS r
JOIN {batch} AS u ON u.sender = r.sender AND u.id > r.id AND u.object_id > ''
    AND u.retracts = 'activity' AND u.object_id = r.activity_id AND r.activity_id > ''
    AND NOT (u.idempotency_key LIKE %(replay_key)s AND u.tag LIKE %(replay_tag)s)

-- name: retraction_rows_at [postgresql]
-- Which of the inboxes %(inboxes)s each of the batches %(batches)s has a
-- delivery to, and whether it was superseded there: a retraction never
-- sent there, taken back itself (an Undo of it), takes nothing back there.
SELECT batch_id, inbox, status = %(superseded)s FROM {delivery}
WHERE batch_id = ANY(%(batches)s::bigint[]) AND inbox = ANY(%(~inboxes)s::varchar[])

-- name: retraction_rows_at [sqlite]
SELECT batch_id, inbox, status = %(superseded)s FROM {delivery}
WHERE batch_id IN (SELECT value FROM json_each(%(batches)s))
    AND inbox IN (SELECT value FROM json_each(%(inboxes)s))

-- name: retraction_rows_at_host [postgresql]
-- Which of the batches %(batches)s have a delivery to the host %(host)s,
-- and whether each of them there was superseded (as retraction_rows_at).
SELECT batch_id, MIN(CASE WHEN status = %(superseded)s THEN 1 ELSE 0 END) FROM {delivery}
WHERE batch_id = ANY(%(batches)s::bigint[]) AND host = %(host)s GROUP BY batch_id

-- name: retraction_rows_at_host [sqlite]
SELECT batch_id, MIN(CASE WHEN status = %(superseded)s THEN 1 ELSE 0 END) FROM {delivery}
WHERE batch_id IN (SELECT value FROM json_each(%(batches)s)) AND host = %(host)s
GROUP BY batch_id

-- name: retracted_held_rows
-- Of the deliveries held back without a request by a deliverer that had
-- claimed them, those never attempted that a retraction sent since (a
-- later batch of their sender's, about their batch's object or of its
-- activity) waits to follow to their inbox, with what it retracts:
-- claimed, they were left to their deliverer, which supersedes them now.
-- Which deliveries, each dialect's statement says.
SELECT d.id, rb.retracts FROM {delivery} AS d
JOIN {batch} AS b ON b.id = d.batch_id
JOIN {batch} AS rb ON rb.sender = b.sender AND rb.id > b.id AND rb.finished_at IS NULL
    AND rb.object_id > '' AND (
        (rb.retracts = 'object' AND rb.object_id = b.object_id AND b.object_id > '')
        OR (rb.retracts = 'activity' AND rb.object_id = b.activity_id AND b.activity_id > ''))
WHERE d.last_attempt_at IS NULL AND d.settled_at IS NULL
    AND EXISTS (
        SELECT 1 FROM {delivery} AS w
        WHERE w.batch_id = rb.id AND w.inbox = d.inbox AND w.settled_at IS NULL)

-- name: retracted_held [postgresql]
-- Those of the deliveries %(ids)s.
{retracted_held_rows}
    AND d.id = ANY(%(ids)s::bigint[])

-- name: retracted_held [sqlite]
{retracted_held_rows}
    AND d.id IN (SELECT value FROM json_each(%(ids)s))

-- name: attempted_before [postgresql]
-- For each inbox of the retraction (%(inboxes)s, as supersede takes them),
-- the last delivery of %(batches)s to it still pending (attempted, or held
-- by a claim): what it waits on.
SELECT inbox, max(id) AS last FROM {delivery}
WHERE batch_id = ANY(%(batches)s::bigint[]) AND settled_at IS NULL
    AND inbox = ANY(%(~inboxes)s::varchar[])
GROUP BY inbox

-- name: attempted_before [sqlite]
SELECT inbox, max(id) AS last FROM {delivery}
WHERE batch_id IN (SELECT value FROM json_each(%(batches)s)) AND settled_at IS NULL
    AND inbox IN ({retraction_inboxes})
GROUP BY inbox

-- name: wait_for_attempted [postgresql]
-- The retraction's delivery to each such inbox waits on that one, with no
-- due time until it leaves the queue, unless it already waits on the one
-- before it in its own sequence. Given as two lists read first: the
-- retraction's deliveries (%(ids)s) and what each waits on (%(lasts)s).
-- Both sides of the join are then lists whose lengths the planner knows;
-- joined to attempted_before as a subquery, the retraction's rows were
-- "one row" to statistics taken while the table was small, and each of
-- 10,000 was compared with the 9,000 attempted (14 s).
UPDATE {delivery} SET after_id = w.last, due_at = NULL
FROM unnest(%(ids)s::bigint[], %(lasts)s::bigint[]) AS w(id, last)
WHERE {delivery}.id = ANY(%(ids)s::bigint[]) AND {delivery}.id = w.id
    AND {delivery}.after_id IS NULL

-- name: wait_for_attempted [sqlite]
UPDATE {delivery} SET after_id = w.last, due_at = NULL
FROM ({attempted_before}) AS w
WHERE {delivery}.batch_id = %(batch)s AND {delivery}.inbox = w.inbox
    AND {delivery}.after_id IS NULL

-- name: stranded
-- Pending deliveries waiting on one that is no longer pending: released
-- by its settle as a rule, but not when it settled while a retraction was
-- making them wait on it (read from the index on after_id).
SELECT w.id FROM {delivery} AS w
WHERE w.after_id IS NOT NULL AND w.settled_at IS NULL
    AND NOT EXISTS (
        SELECT 1 FROM {delivery} AS p WHERE p.id = w.after_id AND p.settled_at IS NULL
    )
LIMIT %(limit)s

-- name: release [postgresql]
-- Those of %(ids)s made due, as release_next makes the next of a sequence:
-- one whose predecessor left while itself waiting waits in its stead on
-- what that one waited on, still pending (inherited). Returning each one's
-- id and what its batch retracts (released_rows).
WITH r AS (
    UPDATE {delivery} SET after_id = {inherited},
        due_at = CASE WHEN {inherited} IS NULL THEN {released_due} ELSE NULL END,
        not_before = CASE WHEN {inherited} IS NULL THEN {released_not_before} ELSE not_before END
    WHERE id = ANY(%(ids)s::bigint[]) AND settled_at IS NULL AND after_id IS NOT NULL
    RETURNING id, batch_id, after_id
)
{released_rows}

-- name: jit_off [postgresql]
-- No JIT compilation until the transaction ends, or jit_as puts back the
-- setting this returns (Statements.release).
SELECT current_setting('jit'), set_config('jit', 'off', true)

-- name: jit_as [postgresql]
SELECT set_config('jit', %(was)s, true)

-- name: release [sqlite]
UPDATE {delivery} SET after_id = {inherited},
    due_at = CASE WHEN {inherited} IS NULL THEN {released_due} ELSE NULL END,
    not_before = CASE WHEN {inherited} IS NULL THEN {released_not_before} ELSE not_before END
WHERE id IN (SELECT value FROM json_each(%(ids)s)) AND settled_at IS NULL
    AND after_id IS NOT NULL
RETURNING {released_rows}

-- name: released_due [postgresql]
-- When the row being written, released, is due: now, but no sooner than
-- the end of a lease that may still run. Its own: made to wait while an
-- attempt of it was in flight (given up, then requeued), it kept the time
-- it was due (not_before). Or that of one it waited on: the due_at it
-- left the queue with, which only give_up leaves (the end of the lease of
-- an attempt of it still in flight), after which the row is to go, as one
-- at a time in its sequence, or a Delete after its Create. Not only the
-- one it waited on: those that one waited on, left too (given up with
-- it, or since), back to the first still pending, a lookup by id a step
-- as inherited walks them: the first given up in flight may be one back.
GREATEST(%(now)s, {delivery}.not_before, {left_lease_end})

-- name: released_due [sqlite]
max(%(now)s, COALESCE({delivery}.not_before, %(now)s), COALESCE({left_lease_end}, %(now)s))

-- name: released_not_before
-- The time a row released is due, kept (not_before) when it is later
-- than now (released_due): the end of a lease that may still run, which a
-- give-up of the row (lease_running), a pause and a resume of its host,
-- keep; a give-up of the row, released, makes what follows it due no
-- sooner (left_lease_end), as it waited. NULL when it is due now.
NULLIF({released_due}, %(now)s)

-- name: left_lease_end
-- The latest due_at of the deliveries the row waited on that left the
-- queue, one after another back from the one it waits on (released_due).
(WITH RECURSIVE back(id) AS (
    SELECT p.id FROM {delivery} AS p WHERE p.id = {delivery}.after_id
    UNION
    SELECT q.after_id FROM back, {delivery} AS q
    WHERE q.id = back.id AND q.settled_at IS NOT NULL
)
SELECT max(q.due_at) FROM back, {delivery} AS q WHERE q.id = back.id AND q.settled_at IS NOT NULL)

-- name: released_rows [postgresql]
-- What a release returns of each row it wrote (r: its id, batch and what
-- it waits on now): its id, what it waits on now (NULL but for one that
-- waits on another still: inherited), and what its batch retracts ('' but
-- for a retraction's, which, released, is then made to wait again:
-- wait_again). The batches are read once, for the ids of those released
-- given as an array, as a settle reads its own (never a lookup a row,
-- planned from statistics that may call the table empty).
SELECT r.id, r.after_id, COALESCE(rb.retracts, '') AS retracts FROM r
LEFT JOIN (
    SELECT id, retracts FROM {batch} WHERE id = ANY(ARRAY(SELECT batch_id FROM r))
) AS rb ON rb.id = r.batch_id
ORDER BY r.id

-- name: released_rows [sqlite]
-- The same. (SQLite 3.40 reads a column the statement set as it was before
-- when an expression of RETURNING tests it: the caller tests it.)
{delivery}.id, {delivery}.after_id,
    (SELECT rb.retracts FROM {batch} AS rb WHERE rb.id = {delivery}.batch_id)

-- name: retractions_waiting [postgresql]
-- Those of %(ids)s still pending that wait on nothing and are a
-- retraction's, with their inbox and their batch: its id, the id it was
-- sent as, sender, what it retracts and what about (what wait_again reads
-- first on PostgreSQL).
SELECT d.id, d.inbox, rb.id, {sent_as}, rb.sender, rb.retracts, rb.object_id
FROM {delivery} AS d JOIN {batch} AS rb ON rb.id = d.batch_id
WHERE d.id = ANY(%(ids)s::bigint[]) AND d.settled_at IS NULL AND d.after_id IS NULL
    AND rb.retracts <> ''
ORDER BY d.id

-- name: wait_again [postgresql]
-- A retraction's deliveries %(ids)s, just released (or, a replay's
-- copies, just written: they overtake nothing), made to wait on the
-- last delivery still pending to their inbox of what they retract
-- (read first by retractions_waiting and attempted_before). A
-- retraction waits on one delivery at a time, the last attempted there
-- when it was queued; one attempted before it may still be retrying when
-- that one leaves, and is waited on then. The time it was just made due is
-- kept (not_before), or, held for its paused host, the time kept already
-- (requeued): released again, it is due no sooner (released_due). One
-- that waits already (a requeued one, its turn in its sequence) keeps that
-- wait, and waits on what it retracts once released: a row waits on one
-- thing at a time, and its turn comes first. Given read first, as a JSON
-- object of ids (%(waits)s: each of %(ids)s's to its last): looked up a row
-- at a time (next_retracted), what each waited on was read through the
-- index on (batch, status) whenever statistics counted a few rows a batch,
-- as many small batches make them, and each row read the whole of a
-- fan-out's batch; and joined to the list as a table, the rows, "one" to
-- statistics that count few pending, were each compared with each. Each
-- row's is a key looked up in the object. One whose last settled since it
-- was read waits on it all the same: stranded, it is freed and made to
-- wait again on the next (release_stranded); left due, it would go before
-- an earlier one still retrying there.
UPDATE {delivery} SET after_id = (%(waits)s::jsonb ->> {delivery}.id::text)::bigint,
    not_before = COALESCE(due_at, not_before), due_at = NULL
WHERE id = ANY(%(ids)s::bigint[]) AND settled_at IS NULL AND after_id IS NULL

-- name: wait_again [sqlite]
UPDATE {delivery} SET after_id = {next_retracted}, not_before = COALESCE(due_at, not_before),
    due_at = NULL
WHERE id IN (SELECT value FROM json_each(%(ids)s)) AND settled_at IS NULL AND after_id IS NULL
    AND {next_retracted} IS NOT NULL

-- name: next_retracted
-- For the row being written, a retraction's delivery: the last delivery to
-- its inbox still pending of its sender's earlier batches about what it
-- retracts (a Delete's object, an Undo's activity); NULL if none (SQLite's
-- wait_again; PostgreSQL reads them first, as lists). Each is
-- read by an index: the batch by its key, the earlier ones by object_id or
-- activity_id (the partial indexes' own conditions written out), a
-- delivery by its batch and inbox.
COALESCE(
    (SELECT max(d.id) FROM {batch} AS rb, {batch} AS b, {delivery} AS d
    WHERE rb.id = {delivery}.batch_id AND rb.retracts = 'object'
        AND b.object_id = rb.object_id AND b.object_id > '' AND b.sender = rb.sender
        AND b.id < {sent_as} AND b.finished_at IS NULL
        AND d.batch_id = b.id AND d.inbox = {delivery}.inbox AND d.settled_at IS NULL),
    (SELECT max(d.id) FROM {batch} AS rb, {batch} AS b, {delivery} AS d
    WHERE rb.id = {delivery}.batch_id AND rb.retracts = 'activity'
        AND b.activity_id = rb.object_id AND b.activity_id > '' AND b.sender = rb.sender
        AND b.id < {sent_as} AND b.finished_at IS NULL
        AND d.batch_id = b.id AND d.inbox = {delivery}.inbox AND d.settled_at IS NULL)
)

-- name: sent_as [postgresql]
-- The id of the batch rb as its retraction was sent, what it retracts
-- being its sender's batches before that: a replay's copy's is its
-- original's, named in its tag, for the copy, written after everything,
-- retracts what the original did, not what the sender sent since (an
-- Update of an actor after its Delete). Only a tag that ends in an id is
-- read as one: a send's could once begin as a replay's (cast, the rest of
-- "replay of batch imports" failed every statement that read it).
CASE WHEN {replay_copy} AND {replay_original} ~ '^[0-9]+$' AND length({replay_original}) <= 18
    THEN CAST({replay_original} AS bigint) ELSE rb.id END

-- name: sent_as [sqlite]
CASE WHEN {replay_copy} AND {replay_original} <> ''
    AND {replay_original} NOT GLOB '*[^0-9]*' AND length({replay_original}) <= 18
    THEN CAST({replay_original} AS bigint) ELSE rb.id END

-- name: replay_copy
rb.idempotency_key LIKE %(replay_key)s AND rb.tag LIKE %(replay_tag)s

-- name: replay_original
substr(rb.tag, CAST(%(replay_tag_start)s AS integer))


-- Ordered deliveries ------------------------------------------------------

-- name: lock_sequences [postgresql]
-- Each of %(keys)s, in the order given, shared where %(shared)s says so and
-- exclusive otherwise; held until the transaction ends. And the
-- transaction's isolation, read before the locks are waited for: a
-- snapshot taken then sees no send that commits meanwhile.
SELECT current_setting('transaction_isolation'), count(CASE WHEN shared
    THEN pg_advisory_xact_lock_shared(key # {this_queue})
    ELSE pg_advisory_xact_lock(key # {this_queue}) END)
FROM unnest(%(keys)s::bigint[], %(shared)s::boolean[]) AS k(key, shared)

-- name: last_of_sequences [postgresql]
-- The last pending delivery of each of %(sequences)s (not of the batch
-- %(batch)s), or NULL: one step back in the partial index on (sequence,
-- id) a sequence, however long its backlog. (Grouped, with MAX, every entry
-- of the sequence was read: 27 ms at 50,000 pending.)
SELECT s.sequence, (
    SELECT d.id FROM {delivery} AS d
    WHERE d.sequence = s.sequence AND d.settled_at IS NULL AND d.sequence <> ''
        AND d.batch_id <> %(batch)s
    ORDER BY d.id DESC LIMIT 1
) FROM unnest(%(sequences)s::varchar[]) AS s(sequence)

-- name: last_of_sequences [sqlite]
-- The index's own condition written out as the index says it: SQLite uses
-- a partial index only for a query that says each of its terms.
SELECT s.value, (
    SELECT d.id FROM {delivery} AS d
    WHERE d.sequence = s.value AND d.settled_at IS NULL AND NOT (d.sequence = '')
        AND d.batch_id <> %(batch)s
    ORDER BY d.id DESC LIMIT 1
) FROM json_each(%(sequences)s) AS s

-- name: release_next [postgresql]
-- Those waiting on %(ids)s made due (but see inherited): one read of the
-- index on after_id. Returning each one's id and what its batch retracts
-- (released_rows).
WITH r AS (
    UPDATE {delivery} SET after_id = {inherited},
        due_at = CASE WHEN {inherited} IS NULL THEN {released_due} ELSE NULL END,
        not_before = CASE WHEN {inherited} IS NULL THEN {released_not_before} ELSE not_before END
    WHERE after_id = ANY(%(ids)s::bigint[]) AND settled_at IS NULL
    RETURNING id, batch_id, after_id
)
{released_rows}

-- name: release_next [sqlite]
UPDATE {delivery} SET after_id = {inherited},
    due_at = CASE WHEN {inherited} IS NULL THEN {released_due} ELSE NULL END,
    not_before = CASE WHEN {inherited} IS NULL THEN {released_not_before} ELSE not_before END
WHERE after_id IN (SELECT value FROM json_each(%(ids)s)) AND settled_at IS NULL
RETURNING {released_rows}

-- name: inherited
-- For the row being written, waiting on one that left the queue while
-- itself waiting (superseded, or given up, unsent): what that one waited
-- on, if it is still pending, which the row waits on in its stead, so that
-- a sequence keeps its order when one in its middle leaves; NULL otherwise.
-- Where what it waited on left too (two in a row superseded by one
-- Delete, or given up together), the chain is followed back, a lookup by
-- id a step, to the first one still pending: one step only would find it
-- settled, and release the row ahead of those still pending before it.
-- (UNION, not UNION ALL: a step seen before ends the walk.) A delivery
-- that was attempted waited on nothing, and releases at once. A row in a
-- sequence takes only one of its own sequence: a retraction that left
-- waited on what it retracts, in another (a Create retrying for hours),
-- and the next of its key would have waited there; it waits instead on
-- the last of its own still pending before it (before_in_sequence), if any,
-- when the one that left left waiting: never attempted, and not in flight
-- (one given up in flight keeps its lease's end as its due time, which
-- what it releases is due no sooner than: released_due).
COALESCE((WITH RECURSIVE back(id) AS (
    SELECT p.after_id FROM {delivery} AS p WHERE p.id = {delivery}.after_id
    UNION
    SELECT q.after_id FROM back, {delivery} AS q
    WHERE q.id = back.id AND q.settled_at IS NOT NULL
)
SELECT q.id FROM back, {delivery} AS q WHERE q.id = back.id AND q.settled_at IS NULL
    AND ({delivery}.sequence = '' OR q.sequence = {delivery}.sequence) LIMIT 1),
    CASE WHEN EXISTS (SELECT 1 FROM {delivery} AS p WHERE p.id = {delivery}.after_id
        AND p.last_attempt_at IS NULL AND p.due_at IS NULL)
    THEN {before_in_sequence} END)

-- name: chain_pairs [postgresql]
-- Of the deliveries of the batches %(ids)s, each (but the first of its
-- sequence among them) with the one before it in its sequence among them,
-- by id: the order they were written in. Read apart from the write (chain),
-- which is then given lists, not a join the planner orders from its
-- statistics.
SELECT id, before FROM (
    SELECT id, LAG(id) OVER (PARTITION BY sequence ORDER BY id) AS before FROM {delivery}
    WHERE batch_id = ANY(%(ids)s::bigint[]) AND sequence <> ''
) AS c
WHERE before IS NOT NULL ORDER BY id

-- name: chain [postgresql]
-- Each of %(ids)s made to wait on the one of %(befores)s at its place.
UPDATE {delivery} SET after_id = v.before, due_at = NULL
FROM unnest(%(ids)s::bigint[], %(befores)s::bigint[]) AS v(id, before)
WHERE {delivery}.id = ANY(%(ids)s::bigint[]) AND {delivery}.id = v.id

-- name: chain [sqlite]
-- The deliveries of the batches %(ids)s, each made to wait on the one
-- before it in its sequence among them (by id: the order they were
-- written in); the first of each sequence is left as it was written.
UPDATE {delivery} SET after_id = c.before, due_at = NULL
FROM (
    SELECT id, LAG(id) OVER (PARTITION BY sequence ORDER BY id) AS before FROM {delivery}
    WHERE batch_id IN (SELECT value FROM json_each(%(ids)s)) AND sequence <> ''
) AS c
WHERE {delivery}.id = c.id AND c.before IS NOT NULL

-- name: promote [postgresql]
-- The deliveries %(ids)s (locked by the send that waits on them), and what
-- each waits on in turn while pending, taken into the lane %(lane)s where
-- theirs is one of %(lanes)s, and one due already made due %(now)s, its
-- place in the lane as of now: a direct message in the key of a fan-out
-- waits on the fan-out's delivery to its inbox, claimed then as soon as it. The walk goes no further than a row
-- of a lane as soon: what that one waits on was taken into its lane when
-- it was queued, so a send behind a backlog in one lane reads one row.
-- What another transaction holds (a settle, a claim) is passed, not
-- waited for: this send holds the rows after it, which a settle's release
-- of the rows after its own locks next.
WITH RECURSIVE waited(id, after_id) AS (
    SELECT d.id, d.after_id FROM {delivery} AS d
    WHERE d.id = ANY(%(ids)s::bigint[]) AND d.settled_at IS NULL
        AND d.lane = ANY(%(lanes)s::varchar[])
    UNION
    SELECT p.id, p.after_id FROM waited JOIN {delivery} AS p ON p.id = waited.after_id
    WHERE p.settled_at IS NULL AND p.lane = ANY(%(lanes)s::varchar[])
), promoted AS (
    SELECT d.id FROM {delivery} AS d WHERE d.id IN (SELECT id FROM waited)
    ORDER BY d.id FOR UPDATE SKIP LOCKED
)
UPDATE {delivery} SET lane = %(lane)s,
    due_at = CASE WHEN {delivery}.due_at <= %(now)s THEN %(now)s ELSE {delivery}.due_at END
FROM promoted WHERE {delivery}.id = promoted.id

-- name: promote [sqlite]
WITH RECURSIVE waited(id, after_id) AS (
    SELECT d.id, d.after_id FROM {delivery} AS d
    WHERE d.id IN (SELECT value FROM json_each(%(ids)s)) AND d.settled_at IS NULL
        AND d.lane IN (SELECT value FROM json_each(%(lanes)s))
    UNION
    SELECT p.id, p.after_id FROM waited JOIN {delivery} AS p ON p.id = waited.after_id
    WHERE p.settled_at IS NULL AND p.lane IN (SELECT value FROM json_each(%(lanes)s))
)
UPDATE {delivery} SET lane = %(lane)s,
    due_at = CASE WHEN due_at <= %(now)s THEN %(now)s ELSE due_at END
WHERE id IN (SELECT id FROM waited)

-- name: waiters_of [postgresql]
-- The pending deliveries that wait on one of %(ids)s: which, and their lane.
SELECT after_id, lane FROM {delivery}
WHERE after_id = ANY(%(ids)s::bigint[]) AND settled_at IS NULL

-- name: waiters_of [sqlite]
SELECT after_id, lane FROM {delivery}
WHERE after_id IN (SELECT value FROM json_each(%(ids)s)) AND settled_at IS NULL

-- name: waited_on_by [postgresql]
-- What each pending delivery of %(ids)s waits on, and the delivery's lane.
SELECT after_id, lane FROM {delivery}
WHERE id = ANY(%(ids)s::bigint[]) AND after_id IS NOT NULL AND settled_at IS NULL

-- name: waited_on_by [sqlite]
SELECT after_id, lane FROM {delivery}
WHERE id IN (SELECT value FROM json_each(%(ids)s)) AND after_id IS NOT NULL
    AND settled_at IS NULL

-- name: lock_deliveries [postgresql]
-- Rows about to be given up that a send may be making a delivery wait on:
-- locked first, in a statement of their own, so that the writing
-- statement begins once that send has committed, and sees its delivery.
SELECT id FROM {delivery} WHERE id = ANY(%(ids)s::bigint[]) ORDER BY id FOR UPDATE

-- name: lock_free_deliveries [postgresql]
-- Rows about to be settled that a send may be making a delivery wait on,
-- and the pending rows waiting on them, which the settle releases: those
-- no other transaction holds, locked first, in a statement of their own,
-- so that the settling statement sees any send that held one before, and
-- waits on none of them. Returns the ids locked, the rows about to be
-- settled one of whose waiting rows another transaction holds (a send
-- locking it as the last of its sequence, a Delete superseding it), and
-- those of the rows that are still there: those held up, and those there
-- that are held themselves, are left for a later settle, never waited
-- for, as that transaction may be a view's, open as long as it likes. Not
-- FOR UPDATE: a transaction that made a row wait on one of these takes a
-- key-share lock on it as it commits (the foreign key), which this must
-- not hold up.
WITH waiting AS (
    SELECT id, after_id FROM {delivery}
    WHERE after_id = ANY(%(ids)s::bigint[]) AND settled_at IS NULL
),
locked AS MATERIALIZED (
    SELECT id FROM {delivery}
    WHERE id = ANY(%(ids)s::bigint[]) OR id = ANY(ARRAY(SELECT id FROM waiting))
    ORDER BY id FOR NO KEY UPDATE SKIP LOCKED
)
SELECT ARRAY(SELECT id FROM locked),
    ARRAY(SELECT after_id FROM waiting WHERE id NOT IN (SELECT id FROM locked)),
    ARRAY(SELECT id FROM {delivery} WHERE id = ANY(%(ids)s::bigint[]))


-- Settling ----------------------------------------------------------------

-- name: settle [postgresql]
-- A settle's writes in one statement: see settling, which it ends.
{settling},
h AS (
    INSERT INTO {history} (minute, delivered, retried, refused, failed, breakers_opened)
    SELECT minute,
        count(*) FILTER (WHERE counted = 'delivered'), count(*) FILTER (WHERE counted = 'retried'),
        count(*) FILTER (WHERE counted = 'refused'), count(*) FILTER (WHERE counted = 'failed'),
        count(*) FILTER (WHERE counted = 'breakers_opened')
    FROM s WHERE counted IS NOT NULL GROUP BY minute ORDER BY minute
    ON CONFLICT (minute) DO UPDATE SET {history_added}
)
{settled_arrays}

-- name: settle_uncounted [postgresql]
-- The same, but for the history, which the caller then adds to itself.
{settling}
{settled_arrays}

-- name: settled_arrays [postgresql]
-- What a settle returns: the ids written, the batches it finished, and the
-- retractions' deliveries it released, to wait again (wait_again): their
-- batches read once, for the ids of those released as an array, as
-- released_rows reads them.
SELECT ARRAY(SELECT id FROM s), ARRAY(SELECT id FROM b WHERE remaining = 0 ORDER BY id),
    ARRAY(SELECT id FROM r WHERE batch_id = ANY(ARRAY(
        SELECT id FROM {batch} WHERE id = ANY(ARRAY(SELECT batch_id FROM r)) AND retracts <> ''
    )))

-- name: settling [postgresql]
-- The settlements written (s), those waiting on the ones written final
-- released (r), the batches of the final ones locked in id order (l) and
-- counted down (b). A batch of one delivery is not locked first: whatever
-- writes its count holds its one delivery's row before it, so no two
-- transactions ever wait on each other for it (and a stream of one-inbox
-- sends settles as many batches as deliveries). Every table is read by an
-- index on ids given as arrays, never by a join the planner orders from
-- its statistics: a table emptied and filled since it was last analyzed
-- is "one row" to it, and a join through all of it at every settle then
-- costs ten times the rest. Each CTE names the one before, so that they
-- run, and lock, in this order. What r releases is due no sooner than
-- its not_before, as released_due says.
WITH v AS ({settled_values}),
s AS (
    UPDATE {delivery} SET {settled_set} FROM v
    WHERE {delivery}.id = ANY(%(ids)s::bigint[]) AND {delivery}.id = v.id
        AND {delivery}.lease_token = v.token
    RETURNING {delivery}.id, {delivery}.batch_id, v.settled_at, v.minute, v.counted
),
r AS (
    UPDATE {delivery} SET due_at = GREATEST(%(now)s, not_before), not_before = NULL,
        after_id = NULL
    WHERE after_id = ANY(%(final)s::bigint[]) AND settled_at IS NULL
        AND after_id IN (SELECT id FROM s WHERE settled_at IS NOT NULL)
    RETURNING id, batch_id
),
c AS (
    SELECT batch_id AS id, count(*) AS n FROM s WHERE settled_at IS NOT NULL GROUP BY batch_id
),
l AS MATERIALIZED (
    SELECT id FROM {batch} WHERE id = ANY(%(leaving)s::bigint[]) AND size > 1
        AND (SELECT count(*) FROM r) >= 0
    ORDER BY id FOR UPDATE
),
b AS (
    UPDATE {batch} SET {counted_down} FROM c
    WHERE {batch}.id = ANY(%(leaving)s::bigint[]) AND {batch}.id = c.id
        AND {batch}.finished_at IS NULL AND (SELECT count(*) FROM l) >= 0
    RETURNING {batch}.id, {batch}.remaining
)

-- name: settled_values [postgresql]
-- A settlement's columns, of the JSON list %(rows)s; jsonb is parsed once,
-- where each ->> of a json value parses its text again.
SELECT (value->>0)::bigint AS id, (value->>1)::varchar AS token, (value->>2)::varchar AS status,
    (value->>3)::integer AS attempts, (value->>4)::timestamptz AS due_at,
    (value->>5)::integer AS last_status, (value->>6)::text AS last_error,
    (value->>7)::timestamptz AS attempted_at, (value->>8)::timestamptz AS settled_at,
    (value->>9)::timestamptz AS minute, (value->>10)::varchar AS counted
FROM jsonb_array_elements(%(rows)s::jsonb)

-- name: settled_values [sqlite]
SELECT json_extract(value, '$[0]') AS id, json_extract(value, '$[1]') AS token,
    json_extract(value, '$[2]') AS status, json_extract(value, '$[3]') AS attempts,
    json_extract(value, '$[4]') AS due_at, json_extract(value, '$[5]') AS last_status,
    json_extract(value, '$[6]') AS last_error, json_extract(value, '$[7]') AS attempted_at,
    json_extract(value, '$[8]') AS settled_at
FROM json_each(%(rows)s)

-- name: settled_set
-- What a write made without an attempt (no attempted_at: a deadline seen at
-- the claim, a pause, a hand-back, SKIP_IF) keeps of the last attempt: its
-- status and its error, unless the write gives its own.
status = v.status, attempts = v.attempts, due_at = v.due_at, lease_token = NULL,
last_status = CASE WHEN v.attempted_at IS NULL AND v.last_status IS NULL
    THEN {delivery}.last_status ELSE v.last_status END,
last_error = CASE WHEN v.attempted_at IS NULL AND v.last_error = '' THEN {delivery}.last_error
    ELSE v.last_error END,
last_attempt_at = COALESCE(v.attempted_at, last_attempt_at), settled_at = v.settled_at

-- name: settle_written [sqlite]
-- The ids whose claim still holds, as one value (each row RETURNING gives
-- back is a step of its own, which hands the interpreter to the worker
-- threads and waits to get it back); the transaction holds the write lock,
-- so nothing changes before they are written.
SELECT json_group_array({delivery}.id) FROM ({settled_values}) AS v
CROSS JOIN {delivery} WHERE {delivery}.id = v.id AND {delivery}.lease_token = v.token

-- name: settle_rows [sqlite]
WITH v AS ({settled_values})
UPDATE {delivery} SET {settled_set} FROM v
WHERE {delivery}.id = v.id AND {delivery}.lease_token = v.token

-- name: give_up [postgresql]
-- One statement that both picks and changes the rows: what it returns is
-- what it changed, whatever another process did a moment before. The token
-- goes, which fences out the late outcome of an attempt in flight, but a
-- row whose lease still runs keeps its end as its due_at: that attempt may
-- still be answered until then, and a requeue makes the row due no sooner.
-- Any other row given up keeps no due time. With %(unheld)s true (the
-- deadline sweep), only rows no claim holds: one claimed since they were
-- read is its claimer's to settle.
UPDATE {delivery} SET status = %(failed)s, due_at = {lease_running}, lease_token = NULL,
    settled_at = %(now)s, last_error = %(reason)s, not_before = NULL
WHERE settled_at IS NULL AND id = ANY(%(ids)s::bigint[])
    AND (lease_token IS NULL OR NOT %(unheld)s)
RETURNING id, batch_id, inbox, last_status, destination

-- name: give_up [sqlite]
UPDATE {delivery} SET status = %(failed)s, due_at = {lease_running}, lease_token = NULL,
    settled_at = %(now)s, last_error = %(reason)s, not_before = NULL
WHERE settled_at IS NULL AND id IN (SELECT value FROM json_each(%(ids)s))
    AND (lease_token IS NULL OR NOT %(unheld)s)
RETURNING id, batch_id, inbox, last_status, destination

-- name: lease_running
-- The end of the row's lease if a claim holds it still (an attempt may be in
-- flight until then), else NULL. A row no claim holds may keep the end of
-- the lease of an attempt given up before (not_before), whether it waits
-- (no due time) or was requeued since (due then): that attempt may be
-- answered until then still, given up twice over.
CASE WHEN {delivery}.lease_token IS NOT NULL AND {delivery}.due_at > %(now)s
    THEN {delivery}.due_at
    WHEN {delivery}.not_before > %(now)s
    THEN {delivery}.not_before END

-- name: requeue [postgresql]
-- Settled deliveries %(ids)s (read and locked first) back in the queue,
-- their attempts kept: due now, but one given up while in flight no sooner
-- than the end of that attempt's lease (give_up), so that it is never sent
-- twice at once.
UPDATE {delivery} SET {requeued}
WHERE id = ANY(%(ids)s::bigint[])

-- name: requeue [sqlite]
UPDATE {delivery} SET {requeued}
WHERE id IN (SELECT value FROM json_each(%(ids)s))

-- name: wait_in_sequence [postgresql]
-- Requeued deliveries %(ids)s with a sequence made to wait, with no due
-- time, on the last delivery of it queued before them that is still
-- pending, if any (one requeued with them too): a requeued Update goes
-- after its Create still retrying, as when it was queued. Each looked up
-- one step back in the partial index on (sequence, id), as
-- last_of_sequences does. One settling meanwhile, before this commits, may
-- leave it waiting on a delivery that has left: the deliverer's sweep
-- releases it (stranded). The time it was due is kept (not_before; held
-- for its paused host, the time kept already): one given up in flight, due
-- when that attempt's lease ends (requeue), is released no sooner
-- (released_due), or it would be sent twice at once.
UPDATE {delivery} SET after_id = {before_in_sequence}, not_before = COALESCE(due_at, not_before),
    due_at = NULL
WHERE id = ANY(%(ids)s::bigint[]) AND sequence <> '' AND {before_in_sequence} IS NOT NULL

-- name: wait_in_sequence [sqlite]
UPDATE {delivery} SET after_id = {before_in_sequence}, not_before = COALESCE(due_at, not_before),
    due_at = NULL
WHERE id IN (SELECT value FROM json_each(%(ids)s)) AND NOT (sequence = '')
    AND {before_in_sequence} IS NOT NULL

-- name: next_in_sequence [postgresql]
-- Of the requeued deliveries %(ids)s (pending again), the next pending
-- delivery of each one's sequence after it, locked: it is to wait on the
-- requeued one (wait_in_sequence), which, leaving, handed it its place
-- (inherited) or released it; requeued, it takes that place again, or the
-- two would be released together, side by side. Only one that waits, or
-- that waits on nothing and was never attempted (no request made, as
-- supersede reads it) nor is held by a claim: one attempted already is
-- past ordering. Each looked up one step forward
-- in the partial index on (sequence, id).
SELECT id FROM {delivery}
WHERE id = ANY(ARRAY(
    SELECT (SELECT d.id FROM {delivery} AS d
        WHERE d.sequence = r.sequence AND d.settled_at IS NULL AND d.sequence <> ''
            AND d.id > r.id
        ORDER BY d.id LIMIT 1)
    FROM {delivery} AS r WHERE r.id = ANY(%(ids)s::bigint[]) AND r.sequence <> ''
))
    AND settled_at IS NULL AND lease_token IS NULL
    AND (after_id IS NOT NULL OR last_attempt_at IS NULL)
ORDER BY id FOR UPDATE

-- name: next_in_sequence [sqlite]
SELECT n.id FROM {delivery} AS n
WHERE n.id IN (
    SELECT (SELECT d.id FROM {delivery} AS d
        WHERE d.sequence = r.sequence AND d.settled_at IS NULL AND NOT (d.sequence = '')
            AND d.id > r.id
        ORDER BY d.id LIMIT 1)
    FROM {delivery} AS r
    WHERE r.id IN (SELECT value FROM json_each(%(ids)s)) AND NOT (r.sequence = '')
)
    AND n.settled_at IS NULL AND n.lease_token IS NULL
    AND (n.after_id IS NOT NULL OR n.last_attempt_at IS NULL)

-- name: before_in_sequence [postgresql]
-- For the row being written, the last pending delivery of its sequence
-- queued before it; NULL if none.
(SELECT d.id FROM {delivery} AS d
    WHERE d.sequence = {delivery}.sequence AND d.settled_at IS NULL AND d.sequence <> ''
        AND d.id < {delivery}.id
    ORDER BY d.id DESC LIMIT 1)

-- name: before_in_sequence [sqlite]
(SELECT d.id FROM {delivery} AS d
    WHERE d.sequence = {delivery}.sequence AND d.settled_at IS NULL AND NOT (d.sequence = '')
        AND d.id < {delivery}.id
    ORDER BY d.id DESC LIMIT 1)

-- name: requeued
-- Due now, but one given up while in flight no sooner than the end of that
-- attempt's lease (give_up), a time kept (not_before) for whatever holds it
-- after: its host paused now, as a send to one is held (queued_values), or
-- later (hosts.hold), then resumed.
status = {pending}, lease_token = NULL, settled_at = NULL, after_id = NULL,
lane = (SELECT b.lane FROM {batch} AS b WHERE b.id = {delivery}.batch_id),
not_before = CASE WHEN {delivery}.due_at > %(now)s THEN {delivery}.due_at END,
due_at = CASE WHEN {host_paused} THEN NULL
    WHEN {delivery}.due_at > %(now)s THEN {delivery}.due_at ELSE %(now)s END

-- name: host_paused
-- Whether the host of the row being written is paused (hosts.pause_host).
EXISTS (SELECT 1 FROM {host} AS h WHERE h.name = {delivery}.host AND h.paused_at IS NOT NULL)


-- Counting batches down ---------------------------------------------------

-- name: counted_down
-- n (c.n, or v.n) fewer remaining, and finished at %(now)s once none are.
-- Every right-hand side reads the row as it was: remaining in finished_at's
-- CASE is the count before.
remaining = CASE WHEN {batch}.remaining > c.n THEN {batch}.remaining - c.n ELSE 0 END,
finished_at = CASE WHEN {batch}.remaining > c.n THEN NULL ELSE %(now)s END

-- name: leaving [postgresql]
-- Batches and how many of their deliveries leave (or, for count_up, come
-- back), of the JSON list %(rows)s.
SELECT (value->>0)::bigint AS id, (value->>1)::integer AS n
FROM jsonb_array_elements(%(rows)s::jsonb)

-- name: leaving [sqlite]
SELECT json_extract(value, '$[0]') AS id, json_extract(value, '$[1]') AS n
FROM json_each(%(rows)s)

-- name: lock_batches [postgresql]
-- In id order: settles counting down the same batches at once wait on each
-- other rather than deadlock.
SELECT id FROM {batch} WHERE id = ANY(%(ids)s::bigint[]) ORDER BY id FOR UPDATE

-- name: count_down [postgresql]
WITH c AS ({leaving})
UPDATE {batch} SET {counted_down} FROM c
WHERE {batch}.id = c.id AND {batch}.finished_at IS NULL
RETURNING {batch}.id, {batch}.remaining

-- name: finishing_batches [sqlite]
-- The batches the count-down finishes, read before it as one value.
SELECT json_group_array({batch}.id) FROM ({leaving}) AS c CROSS JOIN {batch}
WHERE {batch}.id = c.id AND {batch}.finished_at IS NULL AND {batch}.remaining <= c.n

-- name: count_down [sqlite]
WITH c AS ({leaving})
UPDATE {batch} SET {counted_down} FROM c
WHERE {batch}.id = c.id AND {batch}.finished_at IS NULL

-- name: count_up
-- n (c.n) more remaining, of the same JSON list, and not finished: what a
-- requeue puts back in the queue.
WITH c AS ({leaving})
UPDATE {batch} SET remaining = {batch}.remaining + c.n, finished_at = NULL FROM c
WHERE {batch}.id = c.id


-- The history -------------------------------------------------------------

-- name: add_history [postgresql]
-- Counts added to their minutes, of the JSON list %(rows)s: a minute, then
-- each count.
INSERT INTO {history} (minute, delivered, retried, refused, failed, breakers_opened)
SELECT (value->>0)::timestamptz, (value->>1)::integer, (value->>2)::integer,
    (value->>3)::integer, (value->>4)::integer, (value->>5)::integer
FROM jsonb_array_elements(%(rows)s::jsonb)
ON CONFLICT (minute) DO UPDATE SET {history_added}

-- name: add_history [sqlite]
-- (WHERE true: without it, SQLite would read ON as a join's.)
INSERT INTO {history} (minute, delivered, retried, refused, failed, breakers_opened)
SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]'), json_extract(value, '$[2]'),
    json_extract(value, '$[3]'), json_extract(value, '$[4]'), json_extract(value, '$[5]')
FROM json_each(%(rows)s) WHERE true
ON CONFLICT (minute) DO UPDATE SET {history_added}

-- name: history_added
delivered = {history}.delivered + excluded.delivered,
retried = {history}.retried + excluded.retried,
refused = {history}.refused + excluded.refused,
failed = {history}.failed + excluded.failed,
breakers_opened = {history}.breakers_opened + excluded.breakers_opened


-- Hosts as the deliverers saw them ------------------------------------------

-- name: record_hosts [postgresql]
-- Each host's row, added when new, else brought up to date, of the JSON
-- list %(rows)s: its name, the time, then what was seen since the last
-- write (last delivered, last error and when, answer times, its limit, the
-- end of its rest, when it was first sent a request). Another deliverer's
-- later success, error or rest is never undone: each time is the later of
-- the two (the first sighting, the earlier), and a value not seen is left
-- as it was.
-- In name order, the names' code points (COLLATE "C"), as every writer of
-- many hosts locks them: in the database's collation (en_US) a pause and a
-- deliverer crossed, and one was ended (a deadlock).
INSERT INTO {host} (name, scheme, disabled_reason, updated_at, first_seen_at,
    last_delivered_at, last_error, last_error_at, answer_p50_ms, answer_p95_ms,
    concurrency_limit, resting_until)
SELECT value->>0, '', '', (value->>1)::timestamptz, (value->>9)::timestamptz,
    (value->>2)::timestamptz, COALESCE(value->>3, ''), (value->>4)::timestamptz,
    (value->>5)::float8, (value->>6)::float8, (value->>7)::integer, (value->>8)::timestamptz
FROM jsonb_array_elements(%(rows)s::jsonb) ORDER BY (value->>0) COLLATE "C"
ON CONFLICT (name) DO UPDATE SET {hosts_recorded}

-- name: record_hosts [sqlite]
-- (WHERE true: without it, SQLite would read ON as a join's.)
INSERT INTO {host} (name, scheme, disabled_reason, updated_at, first_seen_at,
    last_delivered_at, last_error, last_error_at, answer_p50_ms, answer_p95_ms,
    concurrency_limit, resting_until)
SELECT json_extract(value, '$[0]'), '', '', json_extract(value, '$[1]'),
    json_extract(value, '$[9]'), json_extract(value, '$[2]'),
    COALESCE(json_extract(value, '$[3]'), ''), json_extract(value, '$[4]'),
    json_extract(value, '$[5]'), json_extract(value, '$[6]'), json_extract(value, '$[7]'),
    json_extract(value, '$[8]')
FROM json_each(%(rows)s) WHERE true
ON CONFLICT (name) DO UPDATE SET {hosts_recorded}

-- name: hosts_recorded
updated_at = excluded.updated_at,
first_seen_at = CASE
    WHEN {host}.first_seen_at IS NULL OR excluded.first_seen_at < {host}.first_seen_at
    THEN excluded.first_seen_at
    ELSE {host}.first_seen_at END,
last_delivered_at = CASE
    WHEN {host}.last_delivered_at IS NULL OR excluded.last_delivered_at > {host}.last_delivered_at
    THEN COALESCE(excluded.last_delivered_at, {host}.last_delivered_at)
    ELSE {host}.last_delivered_at END,
last_error = CASE
    WHEN excluded.last_error_at IS NOT NULL
        AND ({host}.last_error_at IS NULL OR excluded.last_error_at > {host}.last_error_at)
    THEN excluded.last_error ELSE {host}.last_error END,
last_error_at = CASE
    WHEN {host}.last_error_at IS NULL OR excluded.last_error_at > {host}.last_error_at
    THEN COALESCE(excluded.last_error_at, {host}.last_error_at)
    ELSE {host}.last_error_at END,
answer_p50_ms = COALESCE(excluded.answer_p50_ms, {host}.answer_p50_ms),
answer_p95_ms = COALESCE(excluded.answer_p95_ms, {host}.answer_p95_ms),
concurrency_limit = COALESCE(excluded.concurrency_limit, {host}.concurrency_limit),
resting_until = CASE
    WHEN {host}.resting_until IS NULL OR excluded.resting_until > {host}.resting_until
    THEN COALESCE(excluded.resting_until, {host}.resting_until)
    ELSE {host}.resting_until END


-- Breakers ----------------------------------------------------------------

-- name: count_failures
-- A destination's failures added to its count, opening its breaker until
-- %(opens)s when they reach %(threshold)s; what it then stands at returned.
INSERT INTO {breaker} (key, failures, open_until, probe_token, probe_until, updated_at)
VALUES (%(key)s, %(count)s, CASE WHEN %(count)s >= %(threshold)s THEN %(opens)s ELSE NULL END,
    '', NULL, %(now)s)
ON CONFLICT (key) DO UPDATE SET
    failures = {breaker}.failures + excluded.failures,
    open_until = CASE WHEN {breaker}.open_until IS NULL
        AND {breaker}.failures + excluded.failures >= %(threshold)s
        THEN %(opens)s ELSE {breaker}.open_until END,
    updated_at = excluded.updated_at
RETURNING {breaker}.failures, {breaker}.open_until


-- Purges ------------------------------------------------------------------

-- name: delete_settled [postgresql]
-- The oldest chunk settled in %(status)s before %(cutoff)s, from
-- %(since)s on. The status and the age are named in the DELETE itself, not
-- only where the ids are found: PostgreSQL checks the DELETE's own
-- conditions again on a row changed since the statement began (requeued,
-- and settled again a moment ago, say), not its subquery's. The ids are
-- looked up by primary key, the subquery run once: as a join, it may be
-- hashed against a scan of the table. Each time deleted is returned in
-- UTC, where the next chunk starts (%(since)s, made aware again): read in
-- TIME_ZONE, as Django reads it with USE_TZ off, a time in the hour a
-- clock goes back through twice is the later of the two, and the next
-- chunk would start an hour on, past rows still to delete.
DELETE FROM {delivery} WHERE id = ANY(ARRAY({oldest_settled})) AND status = %(status)s
    AND settled_at < %(cutoff)s
RETURNING id, settled_at AT TIME ZONE 'UTC'

-- name: delete_settled [sqlite]
DELETE FROM {delivery} WHERE id IN ({oldest_settled}) AND status = %(status)s
    AND settled_at < %(cutoff)s
RETURNING id, settled_at

-- name: oldest_settled
-- A retraction's delivery (its batch's retracts not blank) only once
-- settled before %(retractions_cutoff)s too: a replay tells what it took
-- back by it (replay.py), and must not send that again once it is gone.
-- Its batch is read by primary key, a row at a time: as NOT EXISTS,
-- PostgreSQL may hash every retraction's batch, a scan of the table.
SELECT id FROM {delivery}
WHERE status = %(status)s AND settled_at < %(cutoff)s AND settled_at >= %(since)s
    AND (settled_at < %(retractions_cutoff)s
        OR (SELECT b.retracts FROM {batch} b WHERE b.id = {delivery}.batch_id) = '')
ORDER BY settled_at LIMIT %(chunk)s

-- name: waiting_on [postgresql]
-- The pending deliveries that wait on %(ids)s, deleted: one settled while
-- it was made to wait (a retraction's, a requeue's), which the sweep would
-- have released. Released here as the sweep releases them (release), not
-- left waiting on nothing with no due time: neither claimed nor swept.
SELECT id FROM {delivery}
WHERE after_id >= %(first)s AND after_id <= %(last)s AND after_id = ANY(%(ids)s::bigint[])
    AND settled_at IS NULL

-- name: waiting_on [sqlite]
SELECT id FROM {delivery}
WHERE after_id >= %(first)s AND after_id <= %(last)s
    AND after_id IN (SELECT value FROM json_each(%(ids)s)) AND settled_at IS NULL

-- name: forget_deleted [postgresql]
-- What waited on (or, settled, once waited on) %(ids)s, deleted, points at
-- nothing now. The range is what has SQLite read the index on after_id:
-- once ANALYZE has seen a column of NULLs, it takes an IN alone for a full
-- scan of the table.
UPDATE {delivery} SET after_id = NULL
WHERE after_id >= %(first)s AND after_id <= %(last)s AND after_id = ANY(%(ids)s::bigint[])

-- name: forget_deleted [sqlite]
UPDATE {delivery} SET after_id = NULL
WHERE after_id >= %(first)s AND after_id <= %(last)s
    AND after_id IN (SELECT value FROM json_each(%(ids)s))

-- name: delete_empty_batches
-- Whether a delivery is left is asked by the DELETE itself, so that one
-- queued since the page was read keeps its batch.
DELETE FROM {batch} WHERE id > %(after)s AND id <= %(last)s AND created_at < %(cutoff)s
    AND NOT EXISTS (SELECT 1 FROM {delivery} d WHERE d.batch_id = {batch}.id)


-- Locks, listening and the connection ------------------------------------

-- name: this_queue
-- What tells this queue's advisory locks from another's in the same
-- database (a site of its own in another schema, by its search_path): an
-- advisory lock is the database's, whatever the schema, and one site's
-- round or sequence would otherwise wait on the other's. Its delivery
-- table's oid, mixed into each key (#, exclusive or).
'{delivery}'::regclass::oid::bigint

-- name: try_advisory_lock [postgresql]
SELECT pg_try_advisory_lock(%(key)s::bigint # {this_queue})

-- name: advisory_unlock [postgresql]
SELECT pg_advisory_unlock(%(key)s::bigint # {this_queue})

-- name: advisory_transaction_lock [postgresql]
-- The advisory lock %(key)s, waited for and held until the transaction ends:
-- of a database that may hold no queue (django-q2's schedules, routed
-- elsewhere), so not mixed with this queue's table.
SELECT pg_advisory_xact_lock(%(key)s::bigint)

-- name: holds_advisory_lock [postgresql]
-- Whether this session holds the advisory lock: pg_locks shows a bigint key
-- as its two 32-bit halves.
SELECT EXISTS (
    SELECT 1 FROM pg_locks
    WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted AND objsubid = 1
        AND classid = (((%(key)s::bigint # {this_queue}) >> 32) & 4294967295)::oid
        AND objid = ((%(key)s::bigint # {this_queue}) & 4294967295)::oid
)

-- name: listen [postgresql]
LISTEN {channel}

-- name: unlisten [postgresql]
UNLISTEN {channel}

-- name: ping [postgresql]
-- Asked of a listening connection after a quiet wait: one gone without a
-- word answers nothing.
SELECT 1

-- name: notify [postgresql]
-- Every listening process woken, as a send wakes them: for what a write
-- made due now outside a send (a requeue, a resume, a hand-back).
SELECT pg_notify('{channel}', '')

-- name: journal_mode [sqlite]
PRAGMA journal_mode

-- name: busy_timeout [sqlite]
PRAGMA busy_timeout

-- name: set_busy_timeout [sqlite]
PRAGMA busy_timeout = %(milliseconds)d

-- name: cancel_stuck [postgresql]
-- A deliverer stopping past its grace: the statement its loop's session
-- (the backend %(pid)s) has been running for %(seconds)s or more, waiting on
-- a lock another session holds say, cancelled. Whether one was.
SELECT pg_cancel_backend(pid)
FROM pg_stat_activity
WHERE pid = %(pid)s
  AND state = 'active'
  AND query_start <= clock_timestamp() - make_interval(secs => %(seconds)s)
