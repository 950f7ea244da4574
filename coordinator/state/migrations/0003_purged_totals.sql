-- What purged steps leave behind: their work units by state, and their invalid results, so
-- the project's totals stay whole after a checkpoint purges the rows (BOINC's db_purge).
CREATE TABLE purged (
    what TEXT PRIMARY KEY,   -- a work unit state, or 'invalid_results'
    n    INTEGER NOT NULL
);
CREATE INDEX workunits_step ON workunits(step);
CREATE INDEX events_step ON events(step);
