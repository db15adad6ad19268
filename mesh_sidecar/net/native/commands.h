/* The sidecar's command lines (wire/data_relay.py's grammar), acted on. */
#ifndef MESH_COMMANDS_H
#define MESH_COMMANDS_H

/* One line, without its newline; tokenised in place. */
void control_line(char *line);

#endif
