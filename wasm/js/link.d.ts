// Types of the tab link (link.js): `import "warren-broker/link"` adds `broker.connect()`.
import type { Broker } from "./index.js";

/** A local queue forwarded to a server topic (the outbox). */
export interface ForwardRule {
  queue: string;
  topic: string;
  /** Messages the queue keeps while offline; a publish past it is refused (reject-publish). */
  maxPending?: number;
  /** The same bound in body bytes. */
  maxPendingBytes?: number;
}

/** A server subscription into a local queue (the inbox). */
export interface SubscribeRule {
  topic: string;
  queue: string;
}

export interface LinkOptions {
  /** `ws://` or `wss://` URL of a server Warren's MQTT WebSocket listener. */
  url: string;
  username?: string;
  password?: string;
  /** Sent as the MQTT password; replace it with `link.updateToken()`. */
  token?: string;
  forward?: ForwardRule[];
  subscribe?: SubscribeRule[];
  /** Default `warren-link-<broker name>`: stable, so the server keeps the session. */
  clientId?: string;
  /** Seconds (default 30). */
  keepAlive?: number;
  /** Unacknowledged messages per direction (default 256). */
  inflight?: number;
  /** How long the server keeps the session while the tab is away, in seconds (default 7 days). */
  sessionExpiry?: number;
  /** Largest packet accepted from the server (default 1 MiB). */
  maxPacketSize?: number;
  /** Milliseconds to wait for CONNACK (default 10,000). */
  connectTimeout?: number;
  /** Reconnect backoff in ms: doubling from `min` up to `max`, with jitter (default 250..30,000). */
  reconnect?: { min?: number; max?: number };
  /** Prefix of the ids given to messages without a messageId (default: random per link). */
  linkId?: string;
  /** A WebSocket constructor (default: globalThis.WebSocket; under Node 20 the `ws` package). */
  WebSocket?: unknown;
}

export type LinkState = "connecting" | "up" | "down";

/** What went wrong: `auth` bad credentials (CONNACK 0x86/0x87), `forbidden` a refused publish or
 * subscribe (0x87), `refused` another refusal, `protocol` a malformed server packet, `network`
 * the connection, `local` the tab broker. */
export type LinkErrorCode = "auth" | "forbidden" | "refused" | "protocol" | "network" | "local";

export declare class LinkError extends Error {
  readonly code: LinkErrorCode;
  /** The MQTT reason code, when the server gave one. */
  readonly reason?: number;
  readonly queue?: string;
  readonly topic?: string;
}

export declare class Link {
  readonly state: LinkState;
  readonly clientId: string;
  /** Forwarded messages sent and not yet acknowledged by the server. */
  readonly inflight: number;
  readonly stats: { forwarded: number; received: number; reconnects: number };
  on(event: "state", listener: (state: LinkState) => void): this;
  on(event: "error", listener: (error: LinkError) => void): this;
  off(event: "state" | "error", listener: (...args: any[]) => void): this;
  /** Reconnects with the new token once the messages in flight are acknowledged. */
  updateToken(token: string): void;
  close(): void;
}

export declare const LINK_ID_PROPERTY: "warren-link-id";
export declare const TOPIC_HEADER: "x-link-topic";
export declare function connect(broker: Broker, options: LinkOptions): Link;
export declare function topicMatches(filter: string, topic: string): boolean;

declare module "./dist/warren_wasm.js" {
  interface Broker {
    /** Bridges this broker to a server Warren (needs `import "warren-broker/link"`). */
    connect(options: LinkOptions): Link;
  }
}
