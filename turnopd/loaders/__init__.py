"""Layer 2, under the backends: loading Hugging Face models and vLLM engines, shared by the student's
policy backends and the teachers (so that neither imports the other)."""
