"""What `slotwise[serve]` adds to the services: both in one process (`slotwise serve`), the demo."""
