"""Several models behind one HTTP endpoint: llama-server's router mode, with a process per model
(model_router.child), the loads, unloads and waits (fleet), what a model will hold (memory),
the models a folder and a preset name (catalog) and the HTTP edge (app). Imports no service: a
model runs in a `slotwise serve` process of its own."""
