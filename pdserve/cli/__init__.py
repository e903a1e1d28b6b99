"""The `pdserve` command. It sits above every service (it starts them), so nothing imports it."""
