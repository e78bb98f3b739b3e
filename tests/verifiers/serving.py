"""A verifiers `Toolset` served over MCP's streamable HTTP on 127.0.0.1 by a thread of this
process: the task's tool server at a URL (`ToolsetConfig.url`), as a remote one is reached,
without a server process of its own to start per episode."""

import asyncio
import contextlib
import socket
import threading


@contextlib.contextmanager
def served(toolset):
    """The URL of `toolset`'s MCP endpoint while the block runs."""
    import uvicorn
    from mcp.server.mcpserver import MCPServer
    from mcp.server.transport_security import TransportSecuritySettings

    mcp = MCPServer(toolset.server_name or type(toolset).__name__)
    toolset.register(mcp)
    security = TransportSecuritySettings(enable_dns_rebinding_protection=False)
    app = mcp.streamable_http_app(json_response=True, stateless_http=True, transport_security=security)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/mcp"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
