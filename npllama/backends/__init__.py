"""Executors of the engine on other devices than the CPU (`cuda`); the CPU engine never imports them."""
