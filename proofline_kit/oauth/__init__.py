"""A test authorization server (OAuth 2.1, on the MCP SDK's ``mcp.server.auth``) and the resource
side that makes the system of record require its tokens. Test kit only: never imported by the product."""
