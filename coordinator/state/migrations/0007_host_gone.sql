-- A host that said it stops (a volunteer's last work request says `leaving`) is not counted
-- among the connected hosts, nor waited for, until it asks again.
ALTER TABLE hosts ADD COLUMN gone INTEGER NOT NULL DEFAULT 0;
