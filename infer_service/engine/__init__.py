"""The engine: the loop on its one thread, the client the servicer talks to, the scheduler."""
