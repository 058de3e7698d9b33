// Types of persist.js: `Broker.open` and the durable broker it returns.
import { Broker as CoreBroker, type PublishOptions } from "./dist/warren_wasm.js";

/**
 * What failed: `corrupt` (records that fail their checks at open; `skipped` names them),
 * `quota` (IndexedDB's quota exceeded on a write), `write` (another write failure), `nack`
 * (the broker could not take a message), `closed`, `unsupported` (no IndexedDB, or another
 * `persist`), `locked` (the store is open in another tab).
 */
export type StoreErrorCode = "corrupt" | "quota" | "write" | "nack" | "closed" | "unsupported" | "locked";

export declare class StoreError extends Error {
  readonly code: StoreErrorCode;
  /** `corrupt`: "key (hex): reason" of the records skipped (the first 100). */
  readonly skipped?: string[];
  /** `corrupt`: how many records were skipped. */
  readonly count?: number;
}

export interface OpenOptions {
  persist: "indexeddb";
  /** The store's name (IndexedDB database `warren:<name>`); default "default". */
  name?: string;
  seed?: number;
  /** The broker's clock at open (ms); default `Date.now()`. */
  now?: number;
  /** Open without the records that fail their checks instead of rejecting (`skipped`). */
  skipCorrupt?: boolean;
  /** The transactions' durability hint; default "strict" (flushed to disk before commit). */
  durability?: "strict" | "relaxed" | "default";
  /** After a failed write, when to try again (ms); default 1000. */
  retryMs?: number;
  /**
   * A second opener of the same store: `true` (default) fails with `locked`, "wait" waits
   * for the first to close it, "share" gets a `TabBroker` on the first one's broker.
   */
  lock?: boolean | "wait" | "share";
  /** An IndexedDB other than the global one (Node: fake-indexeddb). */
  indexedDB?: IDBFactory;
  IDBKeyRange?: typeof IDBKeyRange;
}

/** A broker opened with `Broker.open`: publishes resolve once committed to IndexedDB. */
export interface PersistentBroker extends Omit<CoreBroker, "publish" | "mqttPublish"> {
  publish(
    exchange: string,
    routingKey: string,
    body: Uint8Array | string,
    options?: PublishOptions,
  ): Promise<boolean>;
  mqttPublish(topic: string, payload: Uint8Array | string, options?: { retain?: boolean }): Promise<boolean>;
  /** Resolves once every change so far (acks and deletes too) is committed. */
  flush(): Promise<void>;
  /** Commits what is pending and closes the store. */
  close(): Promise<void>;
  on(event: "error", listener: (error: StoreError) => void): void;
  /** With `skipCorrupt`: the records left out at open. */
  readonly skipped: string[];
}

type Async<F> = F extends (...args: infer A) => infer R ? (...args: A) => Promise<Awaited<R>> : never;
type Shared =
  | "declareExchange" | "deleteExchange" | "declareQueue" | "deleteQueue" | "purgeQueue"
  | "bindQueue" | "unbindQueue" | "bindExchange" | "publish" | "get" | "ack" | "nack"
  | "reject" | "cancel" | "queueLength" | "mqttPublish" | "mqttUnsubscribe" | "flush";

/** Another tab's broker (`lock: "share"`): the same methods, each answered asynchronously. */
export type TabBroker = { [K in Shared]: Async<PersistentBroker[K]> } & {
  consume: Async<PersistentBroker["consume"]>;
  mqttSubscribe: Async<PersistentBroker["mqttSubscribe"]>;
  /** Cancels its consumers on the leader tab and stops talking to it (its broker goes on). */
  close(): Promise<void>;
};

export declare class Broker extends CoreBroker {
  static open(options: OpenOptions & { lock: "share" }): Promise<PersistentBroker | TabBroker>;
  static open(options: OpenOptions): Promise<PersistentBroker>;
}
