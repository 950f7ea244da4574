-- No query looks events up by work unit, and the index cost a random-key insert per event:
-- about a fifth of a commit's time (docs/performance-history.md, "The coordinator").
DROP INDEX events_wu;
