-- Structured fields of an event (validation method, results compared, host trust before and
-- after), as JSON, for `tilehive logs validation`.
ALTER TABLE events ADD COLUMN data TEXT NOT NULL DEFAULT '';
