"""Pure wire formats and parsers: bytes in, values or typed errors out.

No module here opens a socket, starts a process, reads a clock or speaks HTTP;
they import only the foundation modules (``errors``, ``identity``, ``units``).
"""
