"""What runs a slot's work: the executor (every llama.cpp call for a slot), the runtime,
sampling, media, the draft model, and the slot and job they work on."""
