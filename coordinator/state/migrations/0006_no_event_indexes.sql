-- The events table is written eight times a work unit and read at a person's pace: by
-- `tilehive logs` and `status`, the dashboard, and the archive before a purge. Its rows are
-- bounded by retention to about two checkpoint intervals, so those reads scan a bounded
-- table by id, while these two indexes cost every event two more B-tree inserts: about 15%
-- of the store's time a work unit (docs/performance-history.md, "The twenty-first round").
DROP INDEX IF EXISTS events_kind;
DROP INDEX IF EXISTS events_step;
