"""Who is in the mesh: the membership state machine, peer health, and the running mesh that drives them."""
