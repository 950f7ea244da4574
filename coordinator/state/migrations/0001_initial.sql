-- tilehive coordinator schema, version 1.
CREATE TABLE gemms (
    id          TEXT PRIMARY KEY,
    step        INTEGER NOT NULL,
    label       TEXT NOT NULL,
    m           INTEGER NOT NULL,
    n           INTEGER NOT NULL,
    k           INTEGER NOT NULL,
    trans_a     INTEGER NOT NULL,
    trans_b     INTEGER NOT NULL,
    tile        INTEGER NOT NULL,
    a_id        TEXT NOT NULL,
    b_id        TEXT NOT NULL,
    policy      TEXT NOT NULL,
    state       TEXT NOT NULL,
    error       TEXT NOT NULL,
    created     REAL NOT NULL
);

CREATE TABLE hosts (
    id                INTEGER PRIMARY KEY,
    name              TEXT NOT NULL,
    token_hash        TEXT NOT NULL UNIQUE,
    created           REAL NOT NULL,
    last_contact      REAL NOT NULL,
    gflops            REAL NOT NULL,
    threads           INTEGER NOT NULL,
    max_memory_mb     INTEGER NOT NULL,
    consecutive_valid INTEGER NOT NULL,
    valid_count       INTEGER NOT NULL,
    invalid_count     INTEGER NOT NULL,
    error_count       INTEGER NOT NULL,
    max_in_progress   INTEGER NOT NULL,
    quarantined       INTEGER NOT NULL
);

CREATE TABLE workunits (
    id                TEXT PRIMARY KEY,
    gemm_id           TEXT NOT NULL REFERENCES gemms(id),
    step              INTEGER NOT NULL,
    i0                INTEGER NOT NULL,
    i1                INTEGER NOT NULL,
    j0                INTEGER NOT NULL,
    j1                INTEGER NOT NULL,
    k                 INTEGER NOT NULL,
    a_panel           TEXT NOT NULL,
    b_panel           TEXT NOT NULL,
    trans_a           INTEGER NOT NULL,
    trans_b           INTEGER NOT NULL,
    kernel_version    INTEGER NOT NULL,
    policy            TEXT NOT NULL,
    target_nresults   INTEGER NOT NULL,
    min_quorum        INTEGER NOT NULL,
    max_error_results INTEGER NOT NULL,
    max_total_results INTEGER NOT NULL,
    delay_bound       REAL NOT NULL,
    state             TEXT NOT NULL,
    canonical_result  TEXT,
    canonical_hash    TEXT,
    error_mask        INTEGER NOT NULL,
    transition_time   REAL NOT NULL,
    accelerated       INTEGER NOT NULL,
    created           REAL NOT NULL
);
CREATE INDEX workunits_gemm ON workunits(gemm_id);
CREATE INDEX workunits_state ON workunits(state);

CREATE TABLE results (
    id               TEXT PRIMARY KEY,
    wu_id            TEXT NOT NULL REFERENCES workunits(id),
    host_id          INTEGER REFERENCES hosts(id),
    server_state     TEXT NOT NULL,
    outcome          TEXT NOT NULL,
    validate_state   TEXT NOT NULL,
    upload_tile      INTEGER NOT NULL,
    sent_time        REAL,
    received_time    REAL,
    report_deadline  REAL,
    output_hash      TEXT,
    has_tile         INTEGER NOT NULL,
    error            TEXT NOT NULL
);
CREATE INDEX results_wu ON results(wu_id);
CREATE INDEX results_host ON results(host_id);

-- Every state change and every validation decision, with its reason (tilehive logs).
CREATE TABLE events (
    id        INTEGER PRIMARY KEY AUTOINCREMENT,
    time      REAL NOT NULL,
    kind      TEXT NOT NULL,
    step      INTEGER,
    gemm_id   TEXT,
    wu_id     TEXT,
    result_id TEXT,
    host_id   INTEGER,
    state     TEXT NOT NULL,
    message   TEXT NOT NULL
);
CREATE INDEX events_kind ON events(kind, id);
CREATE INDEX events_wu ON events(wu_id);

-- The reply to each host's recent work requests, so a retried request gets the same answer.
CREATE TABLE work_replies (
    host_id    INTEGER NOT NULL REFERENCES hosts(id),
    request_id TEXT NOT NULL,
    time       REAL NOT NULL,
    body       BLOB NOT NULL,
    PRIMARY KEY (host_id, request_id)
);
