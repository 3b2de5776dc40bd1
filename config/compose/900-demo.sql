-- docker-compose demo only: passwords for the relay role and an application
-- role that may enqueue. Runs after sql/*.sql (file names sort after them).
ALTER ROLE outboxd_relay PASSWORD 'relay-demo-password';
CREATE ROLE app LOGIN PASSWORD 'app-demo-password' IN ROLE outboxd_writer;
