-- Arrival numbers of wait tickets (syncguard_waiters.arrival): the queue's order.
CREATE SEQUENCE IF NOT EXISTS syncguard_waiters_arrival AS bigint;
