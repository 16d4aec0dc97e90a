"""Installing and making things: llama.cpp builds, synthetic models, caches, units."""
