-- Results not yet sent are no longer written (they promise nothing; after a restart the
-- transitioner issues the replicas a work unit lacks again), and a result's host is now kept
-- from its first write on. Rows of unsent results written before would be assigned a host
-- that their row never took: they are dropped, and issued again like any unsent replica.
DELETE FROM results WHERE server_state = 'unsent';
